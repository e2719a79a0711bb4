"""The waiting room's own keys: the messages, the parked and claimed sets, the lines'
ready index, the trip estimate, the wait notes, the kept copies, a dispatcher's bell.

The core never names them (``tests/project/test_layers.py`` checks it where key names
are built): what the core reads of a limit's line, and the doorbell a freed seat rings,
are named in ``core/keys.py``.
"""

from __future__ import annotations

from ..core.keys import task_key

__all__ = ["arrival_marker", "room_key"]


def room_key(prefix: str, part: str) -> str:
    """A waiting-room key: ``parked``, ``messages``, ``claimed``, ``ready``, ``trip``,
    ``notes``, ``kept``, ``restoring``, or a dispatcher's own ``bell:<id>``."""
    return f"{{{prefix}}}:room:{part}"


def arrival_marker(prefix: str, entry: str) -> str:
    """The token of the copy of ``entry`` that went on (``lua/arrive.lua``): written by an
    acks_late arrival, and by a restore from the ledger (``logged.py``)."""
    return task_key(prefix, "arrived", entry)
