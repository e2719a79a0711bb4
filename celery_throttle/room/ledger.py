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
  elsewhere);
* ``take(entry, token, room)``: a copy of ``entry`` dispatched as ``token``
  in the store's epoch ``room`` is about to ask the store whether it may go
  on (appended and confirmed *before* it asks: a copy that went on always
  has its take in the log);
* ``restored(epoch)``: a restore for the store's epoch ``epoch`` read the log
  up to here.

An entry is *live* (still waiting, to be written back by a restore) from its
first put until its take or its put's drop.  A take counts only if it is not
from before a restore the log has already seen (``room`` older than the last
``restored`` epoch before it): such a copy was dispatched by a store that
has since been lost, and a restore after that record puts its entry back
in line whatever the copy does; it is refused on arrival.  A counted take
is final: the entry is not live again, whatever is put for it later (a
compaction's copy of a put that raced with it, a redelivery of a message
that already went on).  Each taken entry also keeps the token of its first
counted take: that copy, and a redelivery of it, goes on after a restore;
any other copy is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Record", "Replay", "replay"]

Op = Literal["put", "drop", "take", "restored"]


@dataclass(frozen=True, slots=True)
class Record:
    """One change to the waiting tasks kept in the ledger (the module docstring)."""

    op: Op
    entry: str = ""
    mark: str = ""  # put, drop: which put
    token: str = ""  # take: the dispatch that published the copy
    epoch: int = 0  # take: the store's epoch it was dispatched in; restored: restored for
    value: bytes = b""  # put: what a restore writes back (keeper.in_line_kept's form)


@dataclass(slots=True)
class Replay:
    """What the ledger says, read up to some point: the waiting tasks (``live``: entry ->
    (mark, value)) and the copies that took theirs (``taken``: entry -> token)."""

    live: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    taken: dict[str, str] = field(default_factory=dict)
    floor: int = 0  # the newest epoch restored for: takes dispatched before it do not count

    def apply(self, record: Record) -> None:
        """Add one record, read after every record applied before it."""
        entry = record.entry
        if record.op == "put":
            if entry not in self.live and entry not in self.taken:
                self.live[entry] = (record.mark, record.value)
        elif record.op == "drop":
            if self.live.get(entry, ("",))[0] == record.mark:
                del self.live[entry]
        elif record.op == "take":
            if record.epoch >= self.floor and entry not in self.taken:
                self.live.pop(entry, None)
                self.taken[entry] = record.token
        elif record.op == "restored":
            self.floor = max(self.floor, record.epoch)


def replay(records: Iterable[Record], into: Replay | None = None) -> Replay:
    """Apply ``records``, in the ledger's order, to ``into`` (a new :class:`Replay`)."""
    found = Replay() if into is None else into
    for record in records:
        found.apply(record)
    return found
