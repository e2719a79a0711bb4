"""The limits' queues: tasks waiting in line for a rate limit, dispatched when their turn comes.

A task whose wait is long is not given a slot when it arrives (a slot
booked hours ahead freezes the order of a backlog, and its pace): it waits
in the queue of the limit that blocks it, ordered by its *place*, and the
dispatcher (``dispatcher.py``) charges its limits at the moment they admit
it, then publishes it.  So the order is decided when each slot comes: an
urgent task sent behind a backlog goes first, a cancelled backlog frees the
limit at once, and a limit's new rate applies to the tasks already waiting.

* The place: when the task first waited (server clock) plus its priority's
  rank times the ageing step (``throttle_priority_ageing``): rank 0 goes
  first, and a task of rank r sent now goes behind tasks of rank 0 that
  have waited r steps already, so a stream of urgent work never starves the
  rest for ever.
* A fresh task of a limit with a queue joins the line (``Gate.acquire_many``
  with ``in_line``: the decision sees the queue in the same script call).
* A task with several limits waits in the queue of the one that blocks it;
  when another blocks it at its turn, it moves to that one's queue, keeping
  its place.

Keys: each limit's queue (``keys.queue_key``: entry -> place), the
``entries`` hash (entry -> its task id, deadlines and limits, JSON), the
``ready`` index (queue -> when its limit admits a start: the dispatcher
looks only at the due ones, so its work grows with the limits that have
waiting tasks, not with the tasks) and the ``specs`` hash (limit name ->
its interval and burst as the latest code declares them).  Messages, the
claimed set, the trip and the wake list are the waiting room's
(``parking.py``): a task dispatched from a queue arrives as a parked one does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.cluster import RedisCluster

from ..core.keys import epoch_key, queue_of_bucket, room_key, task_key
from ..core.limits import Limit
from ..core.scripts import BUCKET, joined, source
from ..values import from_us

__all__ = ["Queues", "Served", "entry_json"]

#: The most queues looked at per round, and the waiting tasks read per queue.
LOOK_QUEUES, LOOK_HEADS = 64, 8


@dataclass(frozen=True, slots=True)
class Served:
    """A task dispatched from a queue: publish ``message`` with ``token``, ``epoch``,
    ``flag`` ("c" charged for ``start``, server clock us: start then; "x" dispatched
    uncharged: revoked or expired, the worker drops it; "t": its ``max_wait`` passed)
    in its header."""

    entry: str
    token: str
    epoch: int
    flag: str
    start: int
    message: bytes


def entry_json(task_id: str, limits: Sequence[Limit], prefix: str, *, expires_us: int = 0,
               deadline_us: int = 0) -> str:
    """What the dispatch needs of a waiting task: its id, its expiry and ``max_wait``
    deadlines (server clock, us; 0: none) and each limit's bucket, name, rate and cost."""
    return json.dumps({"t": task_id, "e": expires_us, "w": deadline_us,
                       "l": [[lim.key_in(prefix).decode(), lim.name, lim.rate.interval_us,
                              lim.burst, lim.cost] for lim in limits]},
                      separators=(",", ":"))


class Queues:
    """The limits' queues of one key prefix, on one Redis client."""

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.messages, self.entries = room_key(prefix, "messages"), room_key(prefix, "entries")
        self.ready, self.specs = room_key(prefix, "ready"), room_key(prefix, "specs")
        self.claimed, self.wake = room_key(prefix, "claimed"), room_key(prefix, "wake")
        self.trip, self.epoch = room_key(prefix, "trip"), epoch_key(prefix)
        self._enqueue = client.register_script(source(__package__, "enqueue.lua"))
        self._serve = client.register_script(joined(BUCKET, (__package__, "serve.lua")))

    def enqueue(self, entry: str, message: bytes, task_id: str, *, limits: Sequence[Limit],
                blocking: Limit, place_us: int, due_us: int = 0, expires_us: int = 0,
                deadline_us: int = 0, note: str = "", note_ttl_ms: int = 60_000) -> int:
        """Put the task in line for ``blocking`` (one of its ``limits``) at ``place_us``.

        ``due_us``: when ``blocking`` admits a start (server clock; 0: now).
        Returns the server's time (us), or 0 when ``entry`` waits already
        (nothing written: the broker delivered its message again).
        """
        specs: list[str] = []
        for lim in limits:
            specs += [lim.name, f"{lim.rate.interval_us} {lim.burst}"]
        keys: list[str | bytes] = [
            self.messages, self.entries, blocking.queue_in(self.prefix), self.ready, self.wake,
            task_key(self.prefix, "wait", task_id), self.specs]
        args: list[str | bytes | int] = [entry, message, place_us,
                entry_json(task_id, limits, self.prefix, expires_us=expires_us,
                           deadline_us=deadline_us),
                due_us, note, note_ttl_ms, *specs]
        return int(self._enqueue(keys=keys, args=args))

    def declare(self, limits: Sequence[Limit]) -> None:
        """Record ``limits``' rates as the code now declares them (a worker starting with a
        new rate): the tasks already waiting are dispatched at it."""
        items: list[str] = []
        for lim in limits:
            items += [lim.name, f"{lim.rate.interval_us} {lim.burst}"]
        if items:
            self.client.hset(self.specs, items=items)

    def serve_due(self, batch: int, timeout_us: int,
                  revoked: Callable[[str], bool] = lambda task_id: False,
                  ) -> tuple[float | None, list[Served]]:
        """Dispatch the due queues' tasks, up to ``batch``; also seconds until the next due
        queue (0: more are due now; None: no task waits).  ``revoked(task_id)``: such
        tasks are dispatched uncharged (the worker drops them)."""
        reply = self._serve(keys=[self.ready, self.trip], args=["look", LOOK_QUEUES])
        queues = [_text(q) for q in reply[3:]]
        if not queues:
            wait = int(reply[2])
            return (None if wait < 0 else from_us(wait)), []
        heads = self._serve(keys=[self.entries, *queues], args=["heads", LOOK_HEADS])
        others: dict[str, None] = {}  # buckets of the tasks' other limits, in order
        uncharged = []
        i = 0
        for _ in queues:
            count, i = int(heads[i]), i + 1
            for _ in range(count):
                entry, raw = _text(heads[i]), heads[i + 1]
                i += 2
                task = _task(raw)
                if task is None:
                    continue
                if revoked(str(task.get("t", ""))):
                    uncharged.append(entry)
                for lim in _limits_of(task):
                    others[lim] = None
        own = [queue_of_bucket(q) for q in queues]
        for bucket in own:
            others.pop(bucket, None)
        pairs = [k for b in [*own, *others] for k in (b, queue_of_bucket(b))]
        reply = self._serve(
            keys=[self.messages, self.entries, self.ready, self.claimed, self.epoch, self.trip,
                  self.wake, self.specs, *pairs],
            args=["serve", batch, timeout_us, " ".join(uncharged), len(own)])
        wait, epoch, items = int(reply[0]), int(reply[1]), reply[2:]
        served = [Served(_text(items[k]), _text(items[k + 1]), epoch, _text(items[k + 2]),
                         int(items[k + 3]), items[k + 4]) for k in range(0, len(items), 5)]
        return (None if wait < 0 else from_us(wait)), served

    def waiting(self) -> int:
        """How many tasks wait in the limits' queues."""
        return int(self.client.hlen(self.entries))

    def clear(self) -> None:
        """Drop every queue (their messages are the waiting room's, dropped by its purge)."""
        queues = [_text(q) for q in cast(list[bytes], self.client.zrange(self.ready, 0, -1))]
        # One DEL per key: on a Cluster they share a slot, but redis-py's
        # cluster client splits a multi-key DEL anyway.
        for key in [*queues, self.ready, self.entries]:
            self.client.delete(key)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _task(raw: bytes | str) -> dict[str, Any] | None:
    try:
        task = json.loads(raw or b"null")
    except ValueError:
        return None
    return task if isinstance(task, dict) else None


def _limits_of(task: dict[str, Any]) -> list[str]:
    """The bucket keys of a waiting task's limits (none of an unreadable record)."""
    limits = task.get("l")
    if not isinstance(limits, list):
        return []
    buckets = [lim[0] for lim in limits if isinstance(lim, list) and lim]
    return [b for b in buckets if isinstance(b, str) and ":b:" in b]
