"""The waiting room's own keys: the messages, the parked and claimed sets, the lines'
ready index, the trip estimate, the wait notes, the kept copies, a dispatcher's bell.

The core never names them (``tests/project/test_layers.py`` checks it where key names
are built): what the core reads of a limit's line, and the doorbell a freed seat rings,
are named in ``core/keys.py``.
"""

from __future__ import annotations

__all__ = ["room_key"]


def room_key(prefix: str, part: str) -> str:
    """A waiting-room key: ``parked``, ``messages``, ``claimed``, ``ready``, ``trip``,
    ``notes``, ``kept``, or a dispatcher's own ``bell:<id>``."""
    return f"{{{prefix}}}:room:{part}"
