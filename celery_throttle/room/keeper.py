"""Waiting tasks kept beside the broker's queues, where the store would lose them.

A store that keeps its data in memory only (a cache-like Redis of its own:
no AOF, not the broker's server) loses the waiting room in a restart, and
with it every task waiting there: their messages left the broker when they
began to wait.  Where the broker is a Redis server, each waiting task's
message is also *kept* there, in one hash beside the queues: exactly as
durable as a message in a queue, on the same server.  The waiting itself
stays in the store (lines, priorities, fair turns, live rates and the
dispatch are unchanged); the kept copy is only read back when the store
comes back without its data.

* A task starts to wait: its message is kept first, then written to the
  store (a failed store write drops the kept copy again: the task goes back
  to the broker as a countdown instead).  Its header says it is kept.
* A kept task arrives at a worker: the first copy takes the kept copy
  (``lua/keep.lua``, on the broker's server) and goes on; a later copy is
  refused, whatever the store lost meanwhile (a copy dispatched before the
  restart and one dispatched again after it).  An acks_late redelivery of the
  copy that went on carries the same token and goes on again.
* The store comes back empty (a new epoch: ``core/lua/epoch.lua``): a
  dispatcher puts every kept task back where it waited (:meth:`restore`): a
  task in line into its line at its old place (its copy is kept with where
  it waits: :func:`in_line_kept`), a parked one into the room's timer, due
  now; no worker handles it on the way back.  The broker's server
  remembers the epoch it restored for (``seen``), so this happens once per
  loss, whichever node notices it first.  A task that had been dispatched
  already is restored too; the copy arriving second is refused, so the
  limit may lose a start, and no task runs twice.

Keys, on the broker's server: ``kept`` (hash: entry -> what a restore writes
back: a parked task's message, or :func:`in_line_kept`'s value), ``kept:seen``
(the store's epoch restored for) and one marker per taken entry
(``kept:<digest>``, kept for the marker TTL).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import redis

from ..core.keys import task_key
from ..core.scripts import script
from ..values import text
from .keys import room_key

__all__ = ["RESTORE_BATCH", "Keeper", "Kept", "LinePlace", "in_line_kept", "read_kept"]

# The first byte of a kept task in line (a parked task's is its stored envelope's, never
# this one): then where it waits (JSON), a newline, the record its line stores.
_IN_LINE = b"\x10"


@dataclass(frozen=True, slots=True)
class LinePlace:
    """Where a kept task waits in line: its limit's line and turns keys, its place, its
    wait note's digest, its fair key value and units (``lua/enqueue.lua``'s own)."""

    line: str
    turns: str
    place_us: int
    note: str
    fair: str
    units: str


def in_line_kept(where: LinePlace, record: bytes) -> bytes:
    """What is kept of a task in line: ``where`` it waits and the ``record`` its line
    stores, so that a restore puts it straight back in line."""
    spec = [where.line, where.turns, where.place_us, where.note, where.fair, where.units]
    return _IN_LINE + json.dumps(spec, separators=(",", ":")).encode() + b"\n" + record


def read_kept(raw: bytes) -> tuple[LinePlace | None, bytes]:
    """A kept value: where its task waits in line (None: parked) and what its store holds."""
    if raw[:1] != _IN_LINE:
        return None, raw
    spec, _, record = raw[1:].partition(b"\n")
    line, turns, place_us, note, fair, units = json.loads(spec)
    return LinePlace(line, turns, int(place_us), note, fair, units), record

#: The most kept messages read and parked again per round trip.
RESTORE_BATCH = 500

# A bound on the rounds of one restore (HSCAN may return fewer than asked).
_MOST_ROUNDS = 100_000


class Kept(Protocol):
    """Where waiting tasks are kept when the store alone would lose them: beside a Redis
    broker's queues (:class:`Keeper`), or in a log on a RabbitMQ broker
    (``logged.LoggedKeeper``)."""

    def put(self, entry: str, value: bytes, *, patient: bool = True) -> str | None:
        """Keep ``entry``'s value (before the store has it); a handle for :meth:`drop`, or
        None when it was kept already (the same message delivered again).  ``patient``
        False: the caller is the worker's main process, whose thread also consumes the
        broker's messages and runs the worker's shutdown; a keeper that would wait for
        its broker gives up soon instead (``logged.IMPATIENT_S``)."""

    def drop(self, entry: str, handle: str, *, patient: bool = True) -> None:
        """Forget that put (the store refused it: the task waits elsewhere)."""

    def take(self, entry: str, token: str, epoch: int, *, patient: bool = True) -> int:
        """A copy of ``entry`` dispatched as ``token`` in the store's epoch ``epoch``
        arrives: 1 it goes on, 0 it is a duplicate, -1 the store decides.  ``patient``:
        as :meth:`put`'s."""

    def count(self) -> int | None:
        """How many waiting tasks are kept (None: not counted cheaply)."""

    def clear(self) -> None:
        """Forget every kept task (the waiting room was purged)."""

    def restored_for(self) -> str:
        """The store epoch the kept tasks were last restored for ("" never)."""

    def restore(self, epoch: str, park: Callable[[list[tuple[str, bytes]]], None]) -> int:
        """Hand every kept value to ``park`` (in batches), then note ``epoch``; how many."""

    def maintain(self) -> None:
        """Called by the dispatcher's loop: housekeeping, if any is due."""

    def close(self) -> None:
        """Close the clients (another is opened when needed)."""


class Keeper:
    """The kept copies of one key prefix's waiting tasks, on the broker's Redis server."""

    def __init__(self, client: redis.Redis, prefix: str, *, marker_ttl_ms: int) -> None:
        """``marker_ttl_ms``: how long a taken entry's marker lasts; it must outlive every
        copy of the entry still on its way (a re-dispatch, a redelivery)."""
        self.client = client
        self.prefix = prefix
        self.marker_ttl_ms = marker_ttl_ms
        self.kept, self.seen = room_key(prefix, "kept"), room_key(prefix, "kept:seen")
        self._take = client.register_script(script(__package__, "keep.lua"))

    def put(self, entry: str, value: bytes, *, patient: bool = True) -> str | None:
        """Keep ``entry``'s message, or :func:`in_line_kept`'s value (before the store has
        it), unless the entry is kept already; its handle (the entry) when this call kept
        it.  (One write, bounded by the client's timeouts: ``patient`` changes nothing.)

        An entry kept already is the same message copy delivered again: its first
        kept value is the one the store holds (the store refuses the second), and a
        restore must write back what the copy pointer expects, not the second's."""
        return entry if self.client.hsetnx(self.kept, entry, value) else None

    def drop(self, entry: str, handle: str, *, patient: bool = True) -> None:
        """Forget ``entry``'s kept copy (the store refused it: it waits elsewhere)."""
        self.client.hdel(self.kept, entry)

    def take(self, entry: str, token: str, epoch: int = 0, *, patient: bool = True) -> int:
        """A copy of ``entry`` dispatched as ``token`` arrives: 1 it goes on, 0 it is a
        duplicate, -1 unknown here (the store decides).  (Decided here whatever the
        store's ``epoch``.)"""
        return int(self._take(keys=[self.kept, task_key(self.prefix, "kept", entry)],
                              args=[entry, token, self.marker_ttl_ms]))

    def maintain(self) -> None:
        """Nothing to do: a taken copy is deleted as it is taken."""

    def close(self) -> None:
        """Close the client to the broker's server."""
        self.client.close()

    def count(self) -> int | None:
        """How many waiting tasks are kept."""
        return int(self.client.hlen(self.kept))

    def clear(self) -> None:
        """Forget every kept copy (the waiting room was purged)."""
        self.client.delete(self.kept)

    def restored_for(self) -> str:
        """The store epoch the kept copies were last restored for ("" never)."""
        return text(self.client.get(self.seen) or b"")

    def restore(self, epoch: str, park: Callable[[list[tuple[str, bytes]]], None]) -> int:
        """Hand every kept value to ``park`` (batches of (entry, value): the store writes
        back those it does not have, :func:`read_kept`), then note ``epoch`` as restored
        for.  Returns how many were handed over.  Copies taken meanwhile may be written
        back too: their later copy is refused on arrival."""
        handed = 0
        for batch in self._batches():
            park(batch)
            handed += len(batch)
        self.client.set(self.seen, epoch)
        return handed

    def _batches(self) -> Iterator[list[tuple[str, bytes]]]:
        cursor: Any = 0
        for _ in range(_MOST_ROUNDS):
            cursor, found = cast(tuple[Any, dict[bytes, bytes]],
                                 self.client.hscan(self.kept, cursor, count=RESTORE_BATCH))
            if found:
                yield [(text(entry), message) for entry, message in found.items()]
            if int(cursor) == 0:
                return

    def __repr__(self) -> str:
        return f"Keeper(prefix={self.prefix!r})"
