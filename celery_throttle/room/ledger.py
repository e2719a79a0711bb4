"""The ledger: what a store that keeps nothing lost, read back from the broker's own log.

A store that keeps its data in memory only loses the waiting room in a
restart, and with it every task waiting there.  Where the broker is a Redis
server, each waiting task is kept beside its queues (``keeper.py``: a hash
entry per task, taken atomically on arrival).  A RabbitMQ broker cannot
delete one message by id, so there every change is *appended* instead, as a
record in a log the broker keeps durably (``streams.py``), and what a
restore needs is worked out by reading the log back (:func:`replay`):

* ``put(entry, mark, value)``: a task starts to wait (appended and confirmed
  before its store write); ``mark`` names this put: the same message
  delivered again puts its entry again, and its ``drop`` must not cancel the
  first put's;
* ``drop(entry, mark)``: the store refused that put (the task waits
  elsewhere); it counts wherever it is read, before its put too (the two
  may be appended to two generations of the log: ``streams.py``);
* ``take(entry, token, at)``: a copy of ``entry`` dispatched as ``token``
  is about to ask the store whether it may go on (appended and confirmed
  *before* it asks: a copy that went on always has its take in the log;
  ``at``: when, in ms, so that a compaction keeps recent takes only);
* ``mark(token)``: nothing changes; a reader appends one and reads up to it,
  so that it has read every record confirmed before it began.

An entry is *live* (still waiting, to be written back by a restore) from its
first put until its first take or its put's drop.  A take is final: the entry
is not live again, whatever is put for it later (a compaction's copy of a
put that raced with the take, a redelivery of a message that went on).  The
token of an entry's first take is kept too: after a restore, that copy (and
the broker's redelivery of it) goes on, any other copy of the entry is
refused.

A copy refused by the store has taken nothing there, but its take is in
the log: that is safe because the store refuses a copy only when another
copy took the entry, and a copy dispatched before the store's loss asks
only once the restore is done (``parking.py``): its entry is then back in
its line, and its take, after the restore's mark, is the one that counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Record", "Replay", "replay"]

Op = Literal["put", "drop", "take", "mark"]


@dataclass(frozen=True, slots=True)
class Record:
    """One change to the waiting tasks kept in the ledger (the module docstring)."""

    op: Op
    entry: str = ""
    mark: str = ""  # put, drop: which put
    token: str = ""  # take: the dispatch that published the copy; mark: the reader's
    at: int = 0  # take: when (ms since the Unix epoch, the writer's clock)
    value: bytes = b""  # put: what a restore writes back (keeper.in_line_kept's form)


@dataclass(slots=True)
class Replay:
    """What the ledger says, read up to some point: the waiting tasks (``live``: entry ->
    (mark, value)) and the copies that took theirs (``taken``: entry -> (token, at)))."""

    live: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    taken: dict[str, tuple[str, int]] = field(default_factory=dict)
    # Dropped puts (entry, mark): a drop may be read before its put (two generations).
    dropped: set[tuple[str, str]] = field(default_factory=set)

    def apply(self, record: Record) -> None:
        """Add one record, read after every record applied before it."""
        entry = record.entry
        if record.op == "put":
            if entry not in self.live and entry not in self.taken \
                    and (entry, record.mark) not in self.dropped:
                self.live[entry] = (record.mark, record.value)
        elif record.op == "drop":
            self.dropped.add((entry, record.mark))
            if self.live.get(entry, ("",))[0] == record.mark:
                del self.live[entry]
        elif record.op == "take" and entry not in self.taken:
            self.live.pop(entry, None)
            self.taken[entry] = (record.token, record.at)


def replay(records: Iterable[Record], into: Replay | None = None) -> Replay:
    """Apply ``records``, in the ledger's order, to ``into`` (a new :class:`Replay`)."""
    found = Replay() if into is None else into
    for record in records:
        found.apply(record)
    return found
