"""The waiting room: tasks waiting in Redis on the server's clock, not as countdowns.

A task that must wait longer than a sleep in the worker is not re-published
with a countdown (a Celery ETA message held in some worker's memory until
its booked start, on that worker's clock).  It waits in its limit's line
(``lines.py``); one due again at a known time without a charge (a
provider's pause, or its kept copy restored) waits in the room's timer, the
parked set, scored by when it is due on the Redis server's clock.  A
dispatcher in every worker node (``dispatcher.py``) moves due messages back
to their queue, without an ETA.  Three scripts, each a few lines:

* ``lua/park.lua``: store the message and its dispatch time (and the wait
  note), wake a dispatcher if it is the new earliest;
* ``lua/dispatch.lua``: claim the due entries for one dispatcher, ahead of
  time by the measured trip to a worker, with a deadline after which an
  entry whose message never arrived is due again;
* ``lua/arrive.lua``: the first dispatched copy to reach a worker takes the
  entry (and measures its trip); a second copy (its dispatcher died after
  publishing) is refused.

Keys (``keys.room_key``): ``parked`` (sorted set: entry -> dispatch time, us),
``messages`` (hash: entry -> message, compressed: ``envelope.py``),
``claimed`` (sorted set: entry -> deadline), ``wake`` (a list holding at
most one token), ``trip`` (the measured trip from dispatch to arrival, which
dispatches run ahead by) and ``notes`` (hash: task digest -> the wait note
of a task waiting here; its arrival moves it to a key of its own, with a
TTL, for ``celery throttle why`` after the start; a task waiting in line
notes only its entry, ``lines.py``), ``restoring`` (the node restoring the kept
tasks after a loss of the store: :meth:`WaitingRoom.restore_kept`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from ..core.keys import bell_key, epoch_key, key_digest, task_key
from ..core.limits import AnyLimit, Limit
from ..core.logs import logger
from ..core.scripts import script
from ..values import US_PER_SECOND, from_us, text
from .entries import Served, Weights, entry_id, lines_of
from .envelope import Envelope
from .keeper import Kept, LinePlace, in_line_kept, read_kept
from .keys import arrival_marker, room_key
from .lines import MAX_AHEAD_US, Behind, Lines, behind_of

__all__ = ["Parked", "RoomState", "Waiting", "WaitingRoom"]


#: How long a park waits for its replicas (``throttle_park_replicas``).
REPLICA_WAIT_MS = 500
#: After a park that reached too few replicas, parks do not wait for this long.
REPLICA_RETRY_S = 10
#: How long one node keeps the restore of the kept tasks to itself (ms), unless it ends
#: first: longer than a read of the whole log (``streams.READ_TIMEOUT_S``) and its writes.
RESTORE_LOCK_MS = 300_000
#: :meth:`WaitingRoom.restore_kept`'s answer while another node restores: ask again later.
RESTORING_ELSEWHERE = -1


@dataclass(frozen=True, slots=True)
class Parked:
    """One claimed entry: publish ``message`` with ``token`` and ``epoch`` in its header."""

    entry: str
    token: str
    epoch: int
    message: bytes


@dataclass(frozen=True, slots=True)
class Waiting:
    """One parked task as ``celery throttle parked`` lists it."""

    entry: str
    dispatch_in: float  # seconds (negative: overdue)
    message: bytes = field(repr=False)
    note: bytes | None = field(repr=False)  # its wait note (JSON), if it is still there


@dataclass(frozen=True, slots=True)
class RoomState:
    """How many tasks wait, how many are being dispatched, and when the next one is due."""

    parked: int
    dispatching: int
    next_dispatch: float | None  # seconds from now (negative: overdue), None when empty


class WaitingRoom:
    """The waiting room of one key prefix, on one Redis client."""

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str, *,
                 replicas: int = 0, keeper: Kept | None = None) -> None:
        """``keeper``: where waiting tasks are also kept, beside the broker's queues, when
        the store alone would lose them (``keeper.py``; used for writes that ask for it)."""
        self.client = client
        self.prefix = prefix
        self.keeper = keeper
        self.last_epoch = 0  # the store's epoch as the last take_due read it
        self.replicas = replicas  # a park returns once this many replicas have it
        self._unreplicated_until = 0.0  # monotonic: parks do not wait for replicas until then
        self.parked, self.messages = room_key(prefix, "parked"), room_key(prefix, "messages")
        self.claimed, self.wake = room_key(prefix, "claimed"), bell_key(prefix)
        self.trip, self.notes = room_key(prefix, "trip"), room_key(prefix, "notes")
        self.epoch = epoch_key(prefix)
        # redis-py's Script: EVALSHA, reloaded on NOSCRIPT; registering does no I/O.
        self._park = client.register_script(script(__package__, "park.lua"))
        self._dispatch = client.register_script(script(__package__, "dispatch.lua"))
        self._arrive = client.register_script(script(__package__, "arrive.lua"))
        # Reads with the server's clock (state.lua says why scripts), and the purge.
        self._state = client.register_script(script(__package__, "state.lua"))
        self._peek = client.register_script(script(__package__, "peek.lua"))
        self._note = client.register_script(script(__package__, "note.lua"))
        self._where = client.register_script(script(__package__, "where.lua"))
        self._purge = client.register_script(script(__package__, "purge.lua"))
        self.lines = Lines(client, prefix)  # the limits' lines share the messages

    def park(self, entry: str, message: bytes, task_id: str, *, at_us: int = 0,
             delay_us: int = 0, note: str = "", kept: bool = False) -> int:
        """Park ``message`` until ``at_us`` (server clock), or ``delay_us`` from now.

        ``note``: the wait note to leave for ``celery throttle why`` under
        ``task_id``, kept while it waits (its arrival moves it, :meth:`arrive`).
        ``kept``: keep the message beside the broker's queues first
        (:meth:`_stored`).  Returns the dispatch time (server clock, microseconds),
        or 0 when ``entry`` is parked already (nothing written).
        """
        keys = [self.parked, self.messages, self.wake, self.notes]
        args: list[str | bytes | int] = [entry, message, at_us, delay_us, note,
                                         key_digest(task_id)]
        at, _now = self._stored(entry, message, kept,
                                lambda: self._replicated(self._park, keys, args))
        return int(at)

    def enqueue(self, entry: str, message: bytes, task_id: str, *,
                limits: Sequence[AnyLimit], blocking: AnyLimit, place_us: int, due_us: int = 0,
                expires_us: int = 0, deadline_us: int = 0, weights: Weights | None = None,
                kept: bool = False, patient: bool = True) -> int:
        """``Lines.enqueue`` (the same arguments and reply), acknowledged as a park is: once
        ``throttle_park_replicas`` replicas have it.  ``kept``: as :meth:`park`'s;
        ``patient``: as ``Kept.put``'s."""
        keys, args = self.lines.enqueue_call(
            entry, message, task_id, limits=limits, blocking=blocking, place_us=place_us,
            due_us=due_us, expires_us=expires_us, deadline_us=deadline_us, weights=weights)
        return int(self._in_line(entry, keys, args, kept, patient, lambda reply: True))

    def line_up(self, entry: str, message: bytes, task_id: str, *,
                limits: Sequence[AnyLimit], blocking: Limit, place_us: int, within_us: int,
                expires_us: int = 0, deadline_us: int = 0, weights: Weights | None = None,
                kept: bool = False, patient: bool = True) -> Behind:
        """``Lines.line_up`` (the same arguments and reply), acknowledged as :meth:`enqueue`
        is."""
        keys, args = self.lines.enqueue_call(
            entry, message, task_id, limits=limits, blocking=blocking, place_us=place_us,
            expires_us=expires_us, deadline_us=deadline_us, weights=weights,
            within_us=within_us)
        return behind_of(self._in_line(entry, keys, args, kept, patient,
                                       lambda reply: behind_of(reply).ahead != -1))

    def _in_line(self, entry: str, keys: list[str | bytes],
                 args: list[str | bytes | int | float], kept: bool, patient: bool,
                 waits: Callable[[Any], bool]) -> Any:
        """The enqueue script's reply, run with ``keys`` and ``args`` once it is kept (with
        ``kept``) and until the replicas have it; ``waits(reply)``: the task waits in line
        (else its kept copy is dropped)."""
        where = LinePlace(text(keys[1]), text(keys[5]), int(args[2]), text(args[4]),
                          text(args[5]), text(args[6]))
        return self._stored(entry, in_line_kept(where, cast(bytes, args[1])), kept,
                            lambda: self._replicated(self.lines.script, keys, args),
                            waits=waits, patient=patient)

    def _stored(self, entry: str, message: bytes, kept: bool, write: Callable[[], Any],
                waits: Callable[[Any], bool] = lambda reply: True,
                patient: bool = True) -> Any:
        """``write()``'s reply: a store write of a waiting task.  With ``kept``, ``message``
        (what a restore writes back) is kept beside the broker's queues first (so no moment
        finds it in the store alone, which a dispatch could take before the copy is
        there), and that copy is dropped again when the write fails or ``waits(reply)``
        is False (nothing was written: the task does not wait here).  An entry kept
        already (its message delivered again) keeps its first copy, whatever this write
        does: it may be all that is left of the task if the store lost it."""
        if not kept:
            return write()
        if self.keeper is None:
            raise RuntimeError("a kept waiting task needs the room's keeper")
        fresh = self.keeper.put(entry, message, patient=patient)
        try:
            reply = write()
        except BaseException:
            if fresh is not None:
                with contextlib.suppress(Exception):  # (the keeper's own failure, whatever)
                    self.keeper.drop(entry, fresh, patient=patient)
            raise
        if fresh is not None and not waits(reply):
            self.keeper.drop(entry, fresh, patient=patient)
        return reply

    def _replicated(self, script: Script, keys: Sequence[str | bytes],
                    args: Sequence[str | bytes | int | float]) -> Any:
        """Run a script that stores a waiting task; its reply, once the replicas have it."""
        if not self.replicas or time.monotonic() < self._unreplicated_until:
            return script(keys=keys, args=args)
        # The caller acknowledges the task's broker message after this: a
        # failover to a replica that never got the write would lose the task.
        # WAIT counts the replicas that have this connection's writes, so it
        # goes on the script's connection (one pipeline, not a transaction).
        pipe = self.client.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.replicas, REPLICA_WAIT_MS)
        reply, acked = pipe.execute()
        if int(acked) < self.replicas:
            # No replica (after a failover, until one attaches): waiting would
            # stall every park for nothing, so parks stop waiting for a while.
            self._unreplicated_until = time.monotonic() + REPLICA_RETRY_S
            logger.warning("celery_throttle: a waiting task reached %d of %d replicas within "
                           "%d ms: a failover now could lose it (parks do not wait for "
                           "replicas for %d s)", int(acked), self.replicas, REPLICA_WAIT_MS,
                           REPLICA_RETRY_S)
        return reply

    def overdue(self, entries: Sequence[str]) -> None:
        """Claimed ``entries`` whose publish failed are due again at the next claim (their
        claims' deadlines passed: ``lua/dispatch.lua`` dispatches them again)."""
        if entries:
            self.client.zadd(self.claimed, dict.fromkeys(entries, 0), xx=True)

    def take_due(self, batch: int, timeout_us: int) -> tuple[float | None, list[Parked]]:
        """Take up to ``batch`` due entries to dispatch (each is "claimed" until its copy arrives
        or its deadline passes); also seconds until the next (0: more due now).

        None instead of seconds: nothing is parked or being dispatched.
        """
        reply = self._dispatch(keys=[self.parked, self.messages, self.claimed, self.epoch,
                                    self.trip],
                              args=[batch, timeout_us])
        wait, epoch = int(reply[0]), int(reply[1])
        self.last_epoch = epoch
        items = reply[2:]
        parked = [Parked(items[i].decode(), items[i + 1].decode(), epoch, items[i + 2])
                  for i in range(0, len(items), 3)]
        return (None if wait < 0 else from_us(wait)), parked

    def arrive(self, entry: str, token: str, epoch: int, *, marker_ttl_ms: int = 0,
               task_id: str = "", note_ttl_ms: int = 60_000, kept: bool = False,
               held_us: int = 0, patient: bool = True) -> int:
        """May this dispatched copy go on?  0: no, another copy of the entry arrived first;
        else yes, and the server's time (us), which a charged start waits for.

        ``marker_ttl_ms`` > 0 (acks_late): remember the copy that went on for
        that long, so the broker's redelivery of it may go on again.  The
        first copy of ``task_id`` to arrive moves its wait note to a key of
        its own, kept ``note_ttl_ms``.  ``kept``: the entry's message was kept
        beside the broker's queues; which copy goes on is decided there first
        (``Keeper.take``: it knows, whatever the store lost), and the store's
        answer only where it does not.  ``held_us``: how long its node's consumer held
        it before a pool process got it, left out of the trip it measures.  ``patient``:
        as ``Kept.take``'s.
        """
        took = -1
        if kept and self.keeper is not None:
            took = self.keeper.take(entry, token, epoch, patient=patient)
            if took == 0:
                return 0
        marker = arrival_marker(self.prefix, entry)
        wait = task_key(self.prefix, "wait", task_id) if task_id else self.notes
        now = int(self._arrive(keys=[self.messages, self.claimed, marker, self.epoch,
                                      self.trip, self.notes, wait],
                                args=[entry, token, marker_ttl_ms, epoch,
                                      key_digest(task_id) if task_id else "", note_ttl_ms,
                                      MAX_AHEAD_US, max(0, held_us)]))
        if took == 1 and not now:
            # The store saw another copy of the entry, or none, but this one took the kept
            # copy: it is the first (the store's view of it was lost, or restored).
            sec, usec = self.client.time()
            now = _micros(sec, usec)
        return now

    def restore_kept(self, epoch: int) -> int | None:
        """The store's epoch is ``epoch``: if the kept copies were not restored for it (the
        store came back without its data), write every one back where it waited
        (``Keeper.restore``): a task in line into its line at its place, a parked one
        into the timer, due now.  How many were handed over, None when there was nothing
        to do, or :data:`RESTORING_ELSEWHERE` while another node does it.

        One node restores at a time (a lock in the store): with many nodes and a deep
        backlog, each reading the whole log and writing every task back at once would
        multiply the work by the nodes for nothing (the writes change nothing the
        second time).  A node that fails, or dies, leaves it to the next to ask."""
        if self.keeper is None or self.keeper.restored_for() == str(epoch):
            return None
        keeper, lock = self.keeper, room_key(self.prefix, "restoring")
        if not self.client.set(lock, str(epoch), nx=True, px=RESTORE_LOCK_MS):
            return RESTORING_ELSEWHERE
        try:
            if keeper.restored_for() == str(epoch):
                return None  # (restored by a node that had the lock a moment ago)
            return self._restore(keeper, epoch)
        finally:
            # (Past the lock's time another node may hold it: it restores again, which
            # changes nothing.)
            self.client.delete(lock)

    def _restore(self, keeper: Kept, epoch: int) -> int:
        keys = [self.parked, self.messages, self.wake, self.notes]

        def park(batch: list[tuple[str, bytes]]) -> None:
            # (An entry the store has already stays as it is.)  One round trip per batch;
            # a cluster's pipeline does not take scripts, so one per entry there.
            pipe = (self.client.pipeline(transaction=False)
                    if isinstance(self.client, redis.Redis) else None)
            client = self.client if pipe is None else pipe
            for entry, raw in batch:
                where, value = read_kept(raw)
                if where is None:  # due now, no note
                    self._park(keys=keys, args=[entry, value, 0, 0, "", ""], client=client)
                    continue
                # Its line admits it from now on (due 0); its old place keeps its order.
                self.lines.script(
                    keys=[self.messages, where.line, self.lines.ready, self.wake, self.notes,
                          where.turns],
                    args=[entry, value, where.place_us, 0, where.note, where.fair,
                          where.units, ""], client=client)
            if pipe is not None:
                pipe.execute()

        return keeper.restore(str(epoch), park)

    def cancel(self, task_ids: Sequence[str], timeout_us: int) -> tuple[list[Served], int]:
        """Revoked tasks leave the waiting room at once, wherever they wait: those in line are
        taken out of their queue and returned to be dispatched without a charge (their
        worker drops them, and marks them REVOKED), parked ones become due now.  Returns
        those to publish and how many parked ones were made due.  Two calls: the first
        finds the entries and their queues (a script may touch only the keys it is given).
        Tasks that wait nowhere here (started, or waiting as a countdown) are left alone."""
        args: list[str] = []
        for task_id in task_ids:
            args += [key_digest(task_id), entry_id(task_id)]
        reply = self._where(keys=[self.notes, self.messages, self.parked], args=args)
        in_line: dict[str, list[str]] = {}
        parked = []
        for i in range(0, len(reply), 3):
            entry, where = text(reply[i]), text(reply[i + 1])
            if where == "p":
                parked.append(entry)
            elif where == "q":
                in_line[entry] = lines_of(reply[i + 2])
        if not in_line and not parked:
            return [], 0
        return self.lines.cancel(in_line, parked, self.parked, timeout_us)

    def sleep(self, seconds: float, bell: str | None = None) -> bool:
        """Wait up to ``seconds`` for a wake token (a new earliest entry), or for anything
        pushed to ``bell`` (a list of the sleeper's own); True if woken."""
        # BLPOP takes a float timeout (Redis >= 6); 0 would block forever.
        timeout = max(0.001, math.ceil(seconds * 1000) / 1000)
        keys = [self.wake] if bell is None else [self.wake, bell]
        return self.client.blpop(keys, timeout=timeout) is not None

    def next_parked(self, count: int) -> list[Waiting]:
        """The ``count`` parked tasks dispatched next, with their messages and notes."""
        reply = self._peek(keys=[self.parked, self.messages], args=[count])
        now = _micros(reply[0], reply[1])
        items = reply[2:]
        if not items:
            return []
        entries = [items[i].decode() for i in range(0, len(items), 3)]
        scores = [int(float(items[i + 1])) for i in range(0, len(items), 3)]
        messages = [_raw(items[i + 2]) for i in range(0, len(items), 3)]
        notes = [_raw(n) or None for n in self.client.hmget(
            self.notes, [key_digest(Envelope.task_id_in(m)) for m in messages])]
        return [Waiting(e, from_us(score - now), m, n)
                for e, score, m, n in zip(entries, scores, messages, notes, strict=True)]

    def purge(self) -> list[str]:
        """Drop every parked and every dispatched-but-not-arrived task (a dispatched copy that
        arrives later is refused); return their task ids ("" for an unreadable message)."""
        messages = self._purge(keys=[self.parked, self.messages, self.claimed, self.wake,
                                     self.notes])
        self.lines.clear()
        if self.keeper is not None:
            self.keeper.clear()
        return [Envelope.task_id_in(m) for m in messages]

    def state(self) -> RoomState:
        """Counts and the next dispatch time, read in one round trip."""
        sec, usec, parked, claimed, first = self._state(keys=[self.parked, self.claimed])
        nxt = from_us(int(float(first)) - _micros(sec, usec)) if first else None
        return RoomState(int(parked), int(claimed), nxt)


    def read_note(self, task_id: str) -> tuple[int, bytes]:
        """``task_id``'s wait note (b"" if none) and the server's time, in us: one read, on
        the node that holds the prefix.  A note has a key of its own (a task that
        started, or waits as a countdown: ``integration/notes.py``) or, while the
        task waits here, a field of the notes hash; a task in line is noted as "@" and
        its entry (``Lines.find`` reads it)."""
        sec, usec, raw = self._note(
            keys=[task_key(self.prefix, "wait", task_id), self.notes, self.messages],
            args=[key_digest(task_id), entry_id(task_id)])
        return _micros(sec, usec), _raw(raw)


def _micros(sec: bytes | int, usec: bytes | int) -> int:
    return int(sec) * US_PER_SECOND + int(usec)


def _raw(value: bytes | str | None) -> bytes:
    return value.encode() if isinstance(value, str) else value or b""

