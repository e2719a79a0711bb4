"""The limits' lines: tasks waiting in line for a rate limit, dispatched when their turn comes.

A task whose wait is long is not given a booked start when it arrives (a booked start
booked hours ahead freezes the order of a backlog, and its pace): it waits
in the line of the limit that blocks it, ordered by its *place*, and the
dispatcher (``dispatcher.py``) charges its limits at the moment they admit
it, then publishes it.  So the order is decided when each start comes: an
urgent task sent behind a backlog goes first, a cancelled backlog frees the
limit at once, and a limit's new rate applies to the tasks already waiting.

* The place: when the task first waited (server clock) plus its priority's
  rank times the ageing step (``throttle_priority_ageing``): rank 0 goes
  first, and a task of rank r sent now goes behind tasks of rank 0 that
  have waited r steps already, so a stream of urgent work never starves the
  rest for ever.
* A fresh task of a limit with a line joins the line (``Gate.acquire_many``
  with ``in_line``: the decision sees the line in the same script call).
* A task with several limits waits in the line of the one that blocks it;
  when another blocks it at its turn, it moves to that one's line, keeping
  its place.
* Fair share: a limit whose tasks carry a fair key value (``@throttled(...,
  fair=...)``) orders its line by turns instead (``lua/turns.lua``): the
  values are served in turn, each as often as its weight says, whatever
  their numbers of waiting tasks.

Keys: each limit's line (``keys.line_key``: entry -> place), the
waiting room's ``messages`` hash (entry -> one record per waiting task: its
task id, deadlines and limits as JSON, then its message; ``envelope.in_line``),
the ``ready`` index (line -> when its limit admits a start: the dispatcher
looks only at the due ones, so its work grows with the limits that have
waiting tasks, not with the tasks) and the ``specs`` hash (limit name ->
its interval and burst as the code of the worker started last declares
them).  A waiting task is charged at its limits' rates as they are when
its turn comes: an override set at run time (``core/live.py``), else the
declared rate, else the one it was enqueued with.  Messages, the
claimed set, the trip and the wake list are the waiting room's
(``parking.py``): a task dispatched from a line arrives as a parked one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, cast

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from ..core.keys import (
    bell_key,
    epoch_key,
    freed_key,
    key_digest,
    limit_of,
    line_of,
    live_key,
    sibling_key,
    side_key,
    split_limit_key,
)
from ..core.limits import AnyLimit, Limit
from ..core.scripts import script
from ..values import from_us, text
from .entries import (
    InLine,
    Line,
    Served,
    Weights,
    ceiling_us,
    entry_id,
    entry_json,
    fair_of,
    limits_of,
    name_of,
    rows_of,
    served_of,
    task_of,
)
from .envelope import in_line, split_record
from .keys import room_key

__all__ = ["MAX_AHEAD_US", "Behind", "Lines"]

#: The most lines looked at per round, and the waiting tasks read per line.
LOOK_LINES, LOOK_HEADS = 64, 8
#: How long a process uses the dispatch's ahead it read (seconds): the trip
#: estimate it follows moves slowly.
AHEAD_FOR_S = 1.0
#: The most a line is served ahead of its limit's next start (us): the task
#: sleeps that long at most in a worker process, until the start it was
#: charged for.  (A long trip estimate, a node starting up, must not fill it.)
MAX_AHEAD_US = 500_000


class Behind(NamedTuple):
    """Where a task lined up as it arrives stands (:meth:`Lines.line_up`)."""

    #: Tasks in the line before it; 0: none, it waits for its limit's next start; -1: it
    #: would not wait (nothing written); -2: it waits already (nothing written).
    ahead: int
    #: How long (us) its blocking limit admits no start, read when the line was empty.
    wait_us: int


class Lines:
    """The limits' lines of one key prefix, on one Redis client."""

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.messages = room_key(prefix, "messages")
        self.ready, self.specs = room_key(prefix, "ready"), room_key(prefix, "specs")
        self.claimed, self.wake = room_key(prefix, "claimed"), bell_key(prefix)
        self.trip, self.epoch = room_key(prefix, "trip"), epoch_key(prefix)
        self.notes = room_key(prefix, "notes")  # (parking.py's: the wait notes)
        self.freed = freed_key(prefix)  # (the lines a seat was given back in: due now)
        self.live = live_key(prefix)
        self._enqueue = client.register_script(script(__package__, "enqueue.lua"))
        self._due = client.register_script(script(__package__, "due.lua"))
        self._heads = client.register_script(script(__package__, "heads.lua"))
        self._serve = client.register_script(script(__package__, "serve.lua"))
        self._withdraw = client.register_script(script(__package__, "withdraw.lua"))
        self._ahead: tuple[float, int, float] | None = None  # (read at, lead_us, seconds)

    def ahead(self, lead_us: int = 0) -> float:
        """Seconds ahead of a start the dispatch hands out a waiting task (the lead plus
        the measured trip, at most :data:`MAX_AHEAD_US`), as ``serve_due`` computes it;
        read again after :data:`AHEAD_FOR_S`."""
        now = time.monotonic()
        if self._ahead is None or now - self._ahead[0] > AHEAD_FOR_S \
                or self._ahead[1] != lead_us:
            reply = self._due(keys=[self.ready, self.trip, self.freed],
                              args=[0, MAX_AHEAD_US, lead_us])
            self._ahead = (now, lead_us, from_us(int(reply[1])))
        return self._ahead[2]

    def enqueue(self, entry: str, message: bytes, task_id: str, *, limits: Sequence[AnyLimit],
                blocking: AnyLimit, place_us: int, due_us: int = 0, expires_us: int = 0,
                deadline_us: int = 0, weights: Weights | None = None) -> int:
        """Put the task in line for ``blocking`` (one of its ``limits``) at ``place_us``,
        or, when ``blocking`` has a fair key value, at its value's next turn.

        ``due_us``: when ``blocking`` admits a start (server clock; 0: now).
        Returns the server's time (us), or 0 when ``entry`` waits already
        (nothing written: the broker delivered its message again).  The task
        stores one record (its limits and its message, ``envelope.in_line``)
        and no wait note: what ``celery throttle why`` says of it is read from
        the record (:meth:`find`), found from its task id (a copy in line
        again, not the user's own message, leaves a pointer to its entry in
        the notes hash).  (A worker
        enqueues through ``WaitingRoom.enqueue``, which also waits for the
        store's replicas.)
        """
        keys, args = self.enqueue_call(
            entry, message, task_id, limits=limits, blocking=blocking, place_us=place_us,
            due_us=due_us, expires_us=expires_us, deadline_us=deadline_us, weights=weights)
        return int(self._enqueue(keys=keys, args=args))

    def line_up(self, entry: str, message: bytes, task_id: str, *, limits: Sequence[AnyLimit],
                blocking: Limit, place_us: int, within_us: int, expires_us: int = 0,
                deadline_us: int = 0, weights: Weights | None = None) -> Behind:
        """:meth:`enqueue` a task as it arrives, only if it would wait: behind the tasks in
        ``blocking``'s line, or, that line empty, when ``blocking`` admits no start
        within ``within_us`` (a pool process would put it in line then; it waits for
        that start).  (``WaitingRoom.line_up`` also waits for the replicas.)"""
        keys, args = self.enqueue_call(
            entry, message, task_id, limits=limits, blocking=blocking, place_us=place_us,
            expires_us=expires_us, deadline_us=deadline_us, weights=weights,
            within_us=within_us)
        return behind_of(self._enqueue(keys=keys, args=args))

    def enqueue_call(self, entry: str, message: bytes, task_id: str, *,
                     limits: Sequence[AnyLimit], blocking: AnyLimit, place_us: int,
                     due_us: int = 0,
                     expires_us: int = 0, deadline_us: int = 0,
                     weights: Weights | None = None, within_us: int | None = None,
                     ) -> tuple[list[str | bytes], list[str | bytes | int | float]]:
        """The keys and arguments of :meth:`enqueue`'s script (``script``), to run it on
        another connection (a pipeline that also waits for replicas); with ``within_us``,
        :meth:`line_up`'s."""
        keys: list[str | bytes] = [
            self.messages, blocking.line_in(self.prefix), self.ready, self.wake, self.notes,
            blocking.turns_in(self.prefix)]
        fair, units = fair_of(blocking, weights or {})
        record = entry_json(task_id, limits, self.prefix, place_us=place_us,
                            expires_us=expires_us, deadline_us=deadline_us, weights=weights)
        note = "" if entry == entry_id(task_id) else key_digest(task_id)
        args: list[str | bytes | int | float] = [
            entry, in_line(record, message), place_us, due_us, note, fair, repr(units), ""]
        if within_us is not None:
            if not isinstance(blocking, Limit):
                raise TypeError("a task lines up as it arrives behind a rate limit, "
                                f"not {type(blocking).__name__}")
            keys.append(blocking.key_in(self.prefix))
            args[7] = max(within_us, 0)
            args += blocking.script_args()
        return keys, args

    @property
    def script(self) -> Script:
        """The enqueue script (``lua/enqueue.lua``), for :meth:`enqueue_call`'s keys and args."""
        return self._enqueue

    def declare(self, limits: Sequence[Limit]) -> None:
        """Record ``limits``' rates as the code now declares them (a worker starting with a
        new rate): the tasks already waiting are dispatched at it."""
        items: list[str] = []
        for lim in limits:
            items += [lim.name, f"{lim.interval_field} {lim.burst}"]
        if items:
            self.client.hset(self.specs, items=items)

    def serve_due(self, batch: int, timeout_us: int,
                  revoked: Callable[[str], bool] = lambda task_id: False, *,
                  lead_us: int = 0) -> tuple[float | None, list[Served]]:
        """Dispatch the due lines' tasks, up to ``batch``; also seconds until the next due
        line (0: more are due now; None: no task waits).  ``revoked(task_id)``: such
        tasks are dispatched uncharged (the worker drops them).  ``lead_us``: served
        this much ahead of their start, besides the measured trip (as parked tasks are)."""
        reply = self._due(keys=[self.ready, self.trip, self.freed],
                          args=[LOOK_LINES, MAX_AHEAD_US, lead_us])
        lines = [text(q) for q in reply[3:]]
        if not lines:
            wait = int(reply[2])
            return (None if wait < 0 else from_us(wait)), []
        heads = self._heads(keys=[self.messages, *lines], args=[LOOK_HEADS])
        others: dict[str, None] = {}  # buckets of the tasks' other limits, in order
        uncharged = []
        i = 0
        for _ in lines:
            count, i = int(heads[i]), i + 1
            for _ in range(count):
                entry, raw = text(heads[i]), heads[i + 1]
                i += 2
                task = task_of(raw)
                if task is None:
                    continue
                if revoked(str(task.get("t", ""))):
                    uncharged.append(entry)
                for lim in limits_of(task):
                    others[lim] = None
        own = [limit_of(q) for q in lines]
        for bucket in own:
            others.pop(bucket, None)
        quads = [k for b in [*own, *others] for k in (b, *line_of(b), side_key(b))]
        reply = self._serve(
            keys=[self.messages, self.ready, self.claimed, self.epoch, self.trip,
                  self.wake, self.specs, self.live, *quads],
            args=[batch, timeout_us, " ".join(uncharged), len(own), MAX_AHEAD_US, lead_us])
        wait = int(reply[0])
        return (None if wait < 0 else from_us(wait)), served_of(int(reply[1]), reply[2:])

    def cancel(self, in_line: Mapping[str, Sequence[str]], parked: Sequence[str],
               parked_key: str, timeout_us: int) -> tuple[list[Served], int]:
        """Take the ``in_line`` entries (entry -> the lines it may wait in) out of their
        lines, to be dispatched without a charge, and make the ``parked`` ones due now
        (``parked_key``: the waiting room's parked set); ``WaitingRoom.cancel`` finds them."""
        lines = list(dict.fromkeys(q for found in in_line.values() for q in found))
        reply = self._withdraw(
            keys=[self.messages, self.claimed, self.epoch, parked_key, self.wake, *lines],
            args=[timeout_us, " ".join(in_line), " ".join(parked)])
        return served_of(int(reply[1]), reply[2:]), int(reply[0])

    def busiest(self, intervals: Mapping[str, int], *, most: int = 10_000,
              top: int = 5) -> list[Line]:
        """The lines of every limit with waiting tasks (of the first ``most`` lines in the
        ready index), busiest first; ``intervals``: limit name -> interval (us) now."""
        lines = [text(q) for q in cast(list[bytes], self.client.zrange(self.ready, 0,
                                                                          most - 1))]
        pipe = self.client.pipeline(transaction=False)
        for q in lines:
            pipe.zcard(q)
        counts = [int(c) for c in pipe.execute()] if lines else []
        by_name: dict[str, list[tuple[str, int]]] = {}
        seats: set[str] = set()  # names with a line for a seat: no drain estimate
        for q, count in zip(lines, counts, strict=True):
            try:
                kind, digest, name = split_limit_key(q)
            except ValueError:
                continue
            if count:
                by_name.setdefault(name, []).append((digest, count))
                if kind != "q":
                    seats.add(name)
        out = []
        for name, found in by_name.items():
            found.sort(key=lambda item: -item[1])
            interval = None if name in seats else intervals.get(name)
            out.append(Line(name, sum(c for _, c in found), tuple(found[:top]),
                            from_us(found[0][1] * interval) if interval else None))
        return sorted(out, key=lambda line: -line.waiting)

    def next_in_line(self, count: int, name: str | None = None, *,
                     most: int = 1000) -> list[InLine]:
        """The ``count`` tasks nearest the head of their lines (of limit ``name``, or of
        every limit), in the first ``most`` lines of the ready index: places 0 first."""
        lines = [q for q in map(text, cast(list[bytes], self.client.zrange(
            self.ready, 0, most - 1))) if name is None or name_of(q) == name]
        if not lines:
            return []
        pipe = self.client.pipeline(transaction=False)
        for q in lines:
            pipe.zrange(q, 0, count - 1)
        found = sorted(((place, q, text(entry))
                        for q, entries in zip(lines, pipe.execute(), strict=True)
                        for place, entry in enumerate(entries)), key=lambda row: row[0])[:count]
        if not found:
            return []
        messages = cast(list[bytes | None], self.client.hmget(
            self.messages, [entry for _, _, entry in found]))
        out = []
        for (place, q, entry), stored in zip(found, messages, strict=True):
            _, digest, limit = split_limit_key(q)
            out.append(InLine(entry, limit, digest, place, split_record(stored or b"")[1]))
        return out

    def find(self, entry: str) -> tuple[InLine, int] | None:
        """Where ``entry`` waits: its place in the line it is in, its message, and the
        interval (us) that line's limit is charged at now (as the dispatch reads it: the
        live rate, else the declared one, else the one it was enqueued with).  None once
        it left its line (dispatched or dropped)."""
        stored = cast(bytes | None, self.client.hget(self.messages, entry))
        if stored is None:
            return None
        record, message = split_record(stored)
        task = task_of(record or b"")
        if task is None:
            return None
        rows = rows_of(task)
        lines = [line_of(bucket)[0] for bucket, _, _ in rows]
        # One more round trip: its place in each of its limits' lines (it is in
        # one), each limit's live and declared rates, and a concurrency limit's
        # average run.
        pipe = self.client.pipeline(transaction=False)
        for q in lines:
            pipe.zrank(q, entry)
        for (bucket, _, _), q in zip(rows, lines, strict=True):
            name = split_limit_key(q)[2]
            pipe.hget(self.live, name)
            pipe.hget(self.specs, name)
            pipe.hget(sibling_key(bucket, "m"), "run")
        replies, n = pipe.execute(), len(lines)
        places, specs = replies[:n], replies[n:]
        for j, ((_, enqueued, burst), q, place) in enumerate(
                zip(rows, lines, places, strict=True)):
            if place is None:
                continue
            _, digest, name = split_limit_key(q)
            if enqueued:
                spec = specs[3 * j] or specs[3 * j + 1]
                interval = (ceiling_us(text(spec).split()[0]) or enqueued) if spec \
                    else enqueued
            else:  # a seat's line: a turn per average run and seat (0: none ended yet)
                run = specs[3 * j + 2]
                interval = int(float(text(run))) // max(burst, 1) if run else 0
            return InLine(entry, name, digest, int(place), message), interval
        return None

    def look_now(self, name: str) -> int:
        """Look at every line of limit ``name`` now, not when its old rate or pause said
        (``throttle set`` or ``resume``); returns how many lines it has."""
        lines = [q for q in cast(list[bytes], self.client.zrange(self.ready, 0, -1))
                  if name_of(text(q)) == name]
        if lines:
            self.client.zadd(self.ready, dict.fromkeys(lines, 0))
            # A dispatcher asleep until the old time wakes (one token, as park.lua).
            self.client.lpush(self.wake, "1")
            self.client.ltrim(self.wake, 0, 0)
            self.client.pexpire(self.wake, 60_000)
        return len(lines)

    def waiting(self) -> int:
        """How many tasks wait in the limits' lines: every message of the waiting room that
        is neither parked nor being dispatched (three counts in one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hlen(self.messages)
        pipe.zcard(room_key(self.prefix, "parked"))
        pipe.zcard(self.claimed)
        stored, parked, claimed = (int(n) for n in pipe.execute())
        # (Read one after another, not at one instant: never below 0.)
        return max(0, stored - parked - claimed)

    def clear(self) -> None:
        """Drop every line (their messages are the waiting room's, dropped by its purge)."""
        lines = [text(q) for q in cast(list[bytes], self.client.zrange(self.ready, 0, -1))]
        # One DEL per key: on a Cluster they hash alike, but redis-py's
        # cluster client splits a multi-key DEL anyway.
        turns = [line_of(limit_of(q))[1] for q in lines]
        for key in [*lines, *turns, self.ready]:
            self.client.delete(key)


def behind_of(reply: object) -> Behind:
    """:meth:`Lines.line_up`'s reply, from the enqueue script's."""
    ahead, wait = cast(list[int], reply)
    return Behind(int(ahead), int(wait))
