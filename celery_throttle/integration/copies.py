"""The copy pointer: which copy of a task's message may go on (``lua/copies.lua``).

With ``acks_late`` the old message is acknowledged only after the new one is
published: a node that dies in between leaves both, and the broker redelivers
the old one.  And any copy the throttle publishes may be delivered twice: a
broker's at-least-once (a Redis broker's ETA message held past its visibility
timeout, RabbitMQ's dead-lettering between the delay ladder's rungs, a
connection lost before an acknowledgement reached the broker).  So every
re-published message carries a fresh copy id and the id of the copy that
published it, and a pointer in Redis names the one copy
that may go on: moved to the successor after each re-publish, and to
"ran:"/"done:" when a copy starts and ends.  A copy the pointer does not name
is dropped, so exactly one of the two runs.  The copy that started may still
run again if its node dies mid-run (``acks_late``'s at-least-once: the broker
flags that delivery as its redelivery); any other second delivery of a copy is
refused while the first runs (``exits.pointed_copy`` says which copies the
pointer decides).
"""

from __future__ import annotations

import secrets
from typing import Literal

import redis
from redis.cluster import RedisCluster

from ..core.keys import copy_key
from ..core.scripts import script
from ..room.header import WaitState

__all__ = ["CopyPointer", "Verdict", "new_copy"]

#: May a copy go on: "go"; refused while another copy of the task runs ("running": the
#: seats held under the task's id are that copy's); refused after the task's run ended
#: ("ended": no copy holds seats under its id); refused for a newer copy ("stale": the
#: seats under the task's id may be that copy's, given at its dispatch); too late for
#: the start it was admitted for ("late": nothing moved); "rerun": it may go on, as a
#: run again of a copy that started (the broker's redelivery of a run a crash cut off).
Verdict = Literal["go", "rerun", "stale", "running", "ended", "late"]
_VERDICTS: dict[int, Verdict] = {1: "go", 5: "rerun", 0: "stale", 2: "running", 4: "ended",
                                 3: "late"}


class CopyPointer:
    """The copy pointers of one prefix: ``lua/copies.lua``, registered once per client."""

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str, ttl: float) -> None:
        """``ttl``: seconds a pointer outlives its last move: the longest a stranded copy
        can take to come back (the broker's visibility timeout plus the longest booked
        wait, and a minute)."""
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000)
        self._script = client.register_script(script(__package__, "copies.lua"))

    def move(self, task_id: str, retries: int, state: WaitState, then: str, *,
             latest_us: int = 0, once: bool = False) -> Verdict:
        """May this copy go on ("go")?  If so, point the task at ``then``.

        ``latest_us`` (server clock; 0: any time): the latest this copy may start;
        past it the answer is "late" and nothing moves.  ``once``: a start that may
        not run this copy again (``exits.may_run_again``): this copy started
        already means this is a second delivery of it ("running").

        ``then`` is a successor's copy id, or "ran:"/"done:" (this copy's id is
        appended).  One script call per start, end and re-publish of an
        acks_late task.  Raises ``redis.RedisError`` when the store fails (the
        caller decides: a copy re-published meanwhile names this one as its
        predecessor, so the pointer still lets exactly one through).
        """
        mine = state.copy_id
        then_value = then + mine if then.endswith(":") else then
        key = copy_key(self.prefix, task_id, retries)
        return _VERDICTS[int(self._script(
            keys=[key], args=[mine, state.prev, then_value, self.ttl_ms, latest_us,
                              "1" if once else ""]))]


    def check(self, task_id: str, retries: int, state: WaitState) -> Verdict:
        """Would this copy go on?  Nothing moves (``move``'s answer, asked ahead of it)."""
        key = copy_key(self.prefix, task_id, retries)
        return _VERDICTS[int(self._script(
            keys=[key], args=[state.copy_id, state.prev, "", self.ttl_ms, 0]))]


def new_copy() -> str:
    """A fresh copy id."""
    return secrets.token_hex(8)
