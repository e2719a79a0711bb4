"""May waiting tasks wait in this store?  Only where they are kept as well as in the broker.

A task parked in the waiting room, or waiting in a limit's line, exists
only in the store until it is dispatched: its message has left the broker.
So the room is used only where a restart of the store cannot lose what a
restart of the broker would have kept:

* the store *is* the broker's Redis server (one server, one fate: the
  queues and the room are kept or lost together);
* the store appends every write to its file (``appendonly yes``): a killed
  server reloads it, whatever the fsync policy (the kernel holds the writes;
  only a crash of the machine can lose the last second with ``everysec``);
* each park waits for a replica to have it (``throttle_park_replicas``, 1 by
  default with a Sentinel store), so a failover keeps it.

Anything else (a cache-like Redis of its own; RDB snapshots, which lose what
came after the last one) is not safe alone.  Where the broker is a Redis
server, each waiting task is then also *kept* beside the broker's queues
(``keeper.py``, ``beside_broker``): the verdict is safe, and says so with
``kept``.  Otherwise long waits go down the countdown path: the task stays in
the broker as a message with an ETA.  ``anywhere`` (the setting
``throttle_waiting_room = "always"``) parks without asking.

The verdict is checked at the first park, again every :data:`RECHECK_S`, and
after any store error (the server may have come back with another
configuration); it costs one ``INFO persistence`` (and, when the store is
neither persistent nor the broker's URL, one ``INFO server`` on each side).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..core.logs import logger

__all__ = ["RECHECK_S", "Durability", "Verdict", "judge", "server_ids"]

#: Seconds between two checks of the store's configuration.
RECHECK_S = 60.0
#: After a check that could not reach the store, the next one may come this soon.
_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """May tasks wait in the store (``safe``), and why (or why not), in words for a log;
    ``kept``: only with a copy of each kept beside the broker's queues (``keeper.py``)."""

    safe: bool
    reason: str
    kept: bool = False


def _infos(client: redis.Redis | RedisCluster, section: str) -> list[dict[str, Any]]:
    """``INFO section`` of the store's server, or of every primary of a cluster."""
    if not isinstance(client, redis.Redis):  # a cluster (connect.LazyCluster)
        found = client.info(section, target_nodes=RedisCluster.PRIMARIES)
        # One node answers with its dict, several with {node name: dict}.
        values = list(found.values())
        return [v for v in values if isinstance(v, dict)] if values and all(
            isinstance(v, dict) for v in values) else [found]
    return [client.info(section)]


def server_ids(client: redis.Redis | RedisCluster) -> set[str]:
    """The ``run_id`` of the server(s) ``client`` talks to (every primary of a cluster)."""
    return {str(info.get("run_id")) for info in _infos(client, "server")}


def judge(client: redis.Redis | RedisCluster, *, replicas: int, same_url: bool,
          broker_id: Callable[[], str | None]) -> Verdict:
    """The verdict on ``client``'s store (raises ``redis.RedisError`` if it is unreachable).

    ``same_url``: the store's URL is the broker's; ``broker_id()``: the broker's
    server ``run_id``, or None when the broker is not a Redis server.
    """
    if same_url:
        return Verdict(True, "the store is the broker's own Redis server")
    if replicas > 0:
        return Verdict(True, f"each park waits for {replicas} replica(s) to have it "
                             "(throttle_park_replicas)")
    try:
        persistence = _infos(client, "persistence")
    except redis.ResponseError as exc:  # INFO refused (ACLs, a managed service's rules)
        return Verdict(False, f"the store's persistence cannot be read ({exc})")
    if all(str(info.get("aof_enabled", 0)) == "1" for info in persistence):
        return Verdict(True, "the store appends every write to disk (appendonly yes)")
    broker = broker_id()
    if broker is not None and server_ids(client) == {broker}:
        return Verdict(True, "the store is the broker's own Redis server")
    return Verdict(False, "the store keeps waiting tasks in memory only (appendonly no) and "
                          "is not the broker's server: a restart of it would lose them")


class Durability:
    """The store's verdict, as one process last checked it (see the module docstring)."""

    def __init__(self, client: redis.Redis | RedisCluster, *, anywhere: bool, replicas: int,
                 same_url: bool, broker_id: Callable[[], str | None],
                 beside_broker: bool = False,
                 where: str = "beside the broker's queues, on its Redis server",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``beside_broker``: a store that is not safe alone may keep waiting tasks with a
        copy on the broker (there is a place for it, and the setting allows it), ``where``
        (in words for a log)."""
        self.client = client
        self.anywhere = anywhere
        self.beside_broker = beside_broker
        self.where = where
        self.replicas = replicas
        self.same_url = same_url
        self.broker_id = broker_id
        self.clock = clock
        self._current: Verdict | None = None  # answered until _due
        self._known: Verdict | None = None  # the last check that reached the store
        self._due = 0.0
        self._lock = threading.Lock()  # (the threads pool parks from several threads)

    def verdict(self) -> Verdict:
        """The verdict, checked again if it is due (never raises: unreachable is unsafe)."""
        if self.anywhere:
            return Verdict(True, 'throttle_waiting_room = "always"')
        with self._lock:
            if self._current is not None and self.clock() < self._due:
                return self._current
            try:
                found = judge(self.client, replicas=self.replicas, same_url=self.same_url,
                              broker_id=self.broker_id)
            except (redis.RedisError, OSError) as exc:
                # Down: nothing can wait there now anyway (and parking would fail).
                self._current = Verdict(False, "the store could not be checked "
                                               f"({type(exc).__name__})")
                self._due = self.clock() + _RETRY_S
                return self._current
            if not found.safe and self.beside_broker:
                found = Verdict(True, f"{found.reason}, so each waiting task is also kept "
                                      f"{self.where}", kept=True)
            before, self._known = self._known, found
            self._current, self._due = found, self.clock() + RECHECK_S
        if before is not None and (before.safe, before.kept) != (found.safe, found.kept):
            # The store came back with another configuration (or was reconfigured).
            logger.warning("celery_throttle: the waiting room is now %s: %s",
                           "in use" if found.safe else
                           "not used (long waits are re-published with a countdown)",
                           found.reason)
        return found

    def adopt(self, other: Durability) -> None:
        """Answer ``other``'s last verdict until it is due (the process that forked this
        one checked it: the same store, and the monotonic clock is the machine's).
        Read without ``other``'s lock, which a thread of the forking process may have
        held at the fork."""
        self._current, self._known, self._due = other._current, other._known, other._due

    def safe(self) -> bool:
        """May a task wait in the store now?"""
        return self.verdict().safe

    def invalidate(self) -> None:
        """Check again at the next question (after a store error: it may have restarted)."""
        with self._lock:
            self._due = 0.0
