"""The copy pointer: which copy of an acks_late task's message may go on (``lua/copies.lua``).

With ``acks_late`` the old message is acknowledged only after the new one is
published: a node that dies in between leaves both, and the broker redelivers
the old one.  So every re-published message carries a fresh copy id and the
id of the copy that published it, and a pointer in Redis names the one copy
that may go on: moved to the successor after each re-publish, and to
"ran:"/"done:" when a copy starts and ends.  A copy the pointer does not name
is dropped, so exactly one of the two runs.  The copy that started may still
run again if its node dies mid-run: that is ``acks_late``'s at-least-once.
"""

from __future__ import annotations

import importlib.resources
import secrets

from .keys import copy_key
from .store import Runtime
from .wait_state import WaitState

__all__ = ["move_pointer", "new_copy"]

_COPIES = importlib.resources.files(__package__).joinpath("lua/copies.lua").read_text("utf-8")


def move_pointer(runtime: Runtime, task_id: str, retries: int, state: WaitState,
                 then: str) -> bool:
    """May this copy go on?  If so, point the task at ``then``.

    ``then`` is a successor's copy id, or "ran:"/"done:" (this copy's id is
    appended).  One script call per start, end and re-publish of an
    acks_late task.  The pointer outlives the time a stranded copy can take
    to come back: the broker's visibility timeout plus the longest booked
    wait.  Raises ``redis.RedisError`` when the store fails (the caller
    decides: a copy re-published meanwhile names this one as its
    predecessor, so the pointer still lets exactly one through).
    """
    mine = state.copy_id
    then_value = then + mine if then.endswith(":") else then
    key = copy_key(runtime.config.prefix, task_id, retries)
    ttl_ms = int((runtime.config.visibility_timeout + runtime.config.horizon) * 1000) + 60_000
    script = runtime.gate.client.register_script(_COPIES)  # no I/O: EVALSHA, NOSCRIPT reload
    return bool(script(keys=[key], args=[mine, state.prev, then_value, ttl_ms]))


def new_copy() -> str:
    """A fresh copy id."""
    return secrets.token_hex(8)
