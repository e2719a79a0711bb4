"""Where each app's gate lives: one :class:`Gate` and :class:`Config` per app and process.

Cached per app (never a module-global client that ignores the app) and keyed
by process id: Celery's prefork pool forks children after the parent may have
used Redis, and a socket shared across a fork interleaves two processes'
replies.  ``worker_process_init`` also drops the cache explicitly.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from celery import Celery

from ..core.connect import connect
from ..core.gate import Gate
from ..core.live import LiveLimits
from ..core.logs import Every
from ..room.durability import Durability, server_ids
from ..room.keeper import Keeper, Kept
from ..room.logged import LoggedKeeper
from ..room.parking import WaitingRoom
from ..values import LONGEST_WAIT
from .config import Config, read_config
from .copies import CopyPointer
from .history import CountsWriter

__all__ = ["INSTALLED", "KEPT_MARKER_S", "SHADOW_SUFFIX", "Runtime", "durability_of", "forget",
           "keeper_of", "runtime_for"]

#: Appended to the app's prefix for the buckets of limits in shadow mode (a hash tag
#: of their own: a shadow decision never spans a real bucket).
SHADOW_SUFFIX = ".shadow"

#: The least a taken kept entry's marker lasts (seconds, ``room/keeper.py``).
KEPT_MARKER_S = 3600.0

#: Set on an app by ``install(app)``: its workers run a dispatcher, so the
#: waiting room may be used (without one, parked tasks would never leave it).
INSTALLED = "_celery_throttle_installed"


@dataclass(frozen=True)
class Runtime:
    """An app's validated settings and its gate, for one process."""

    config: Config
    gate: Gate
    room: WaitingRoom
    copies: CopyPointer
    live: LiveLimits
    durability: Durability  # may tasks wait in the store?
    pid: int
    counts: CountsWriter  # this process's counts per second, for the dashboard
    shadow: Gate  # the buckets of limits in shadow mode (integration/shadow.py)
    outage: Every = field(default_factory=Every)  # reports a store outage once per 30 s


_cache: weakref.WeakKeyDictionary[Celery, Runtime] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # the threads pool may build the runtime concurrently


def runtime_for(app: Celery) -> Runtime:
    """The runtime of ``app`` in this process (built on first use)."""
    rt = _cache.get(app)
    if rt is not None and rt.pid == os.getpid():
        return rt
    with _lock:
        rt = _cache.get(app)
        if rt is None or rt.pid != os.getpid():
            config = read_config(app)
            # Short timeouts: a dead store must turn into the on_error policy
            # quickly, not hold a worker process for the OS TCP timeout.
            client = config.connect(socket_timeout=5, socket_connect_timeout=2,
                                    health_check_interval=30)
            durability = durability_of(config, client)
            if rt is not None:  # (the runtime of the process this one was forked from)
                durability.adopt(rt.durability)
            rt = Runtime(config, Gate(client, prefix=config.prefix),
                         WaitingRoom(client, config.prefix, replicas=config.park_replicas,
                                     keeper=keeper_of(config, app)),
                         # (A pointer outlives the longest wait, in line or booked.)
                         CopyPointer(client, config.prefix, config.visibility_timeout
                                     + max(config.horizon, LONGEST_WAIT) + 60),
                         LiveLimits(client, config.prefix), durability,
                         os.getpid(), CountsWriter(client, config.prefix),
                         Gate(client, prefix=config.prefix + SHADOW_SUFFIX))
            _cache[app] = rt
        return rt


def durability_of(config: Config, client: Any) -> Durability:
    """Whether tasks may wait in ``client``'s store (``room/durability.py``), for ``config``."""
    return Durability(client, anywhere=config.park_anywhere, replicas=config.park_replicas,
                      same_url=config.store_is_broker,
                      broker_id=lambda: _broker_id(config.broker_redis_url),
                      beside_broker=_keeps(config),
                      where=("in a log on the broker (RabbitMQ)" if config.broker_amqp else
                             "beside the broker's queues, on its Redis server"))


def _beside(config: Config) -> bool:
    """Is there a place on the broker for waiting tasks: a Redis broker that is not the
    store's URL (``room/keeper.py``), or RabbitMQ (``room/logged.py``)?"""
    return (config.broker_redis_url is not None and not config.store_is_broker) \
        or config.broker_amqp


def _keeps(config: Config) -> bool:
    """Are waiting tasks kept beside the broker's queues (``room/keeper.py``) when the
    store alone would lose them?"""
    return config.keep_beside_broker and _beside(config)


def keeper_of(config: Config, app: Celery) -> Kept | None:
    """Where waiting tasks are kept on the broker, with clients of its own: beside a Redis
    broker's queues (``room/keeper.py``), or in a log on RabbitMQ (``room/logged.py``);
    None where there is no such place.  Made whatever the setting says: a task kept while
    it was on is still taken by its arrival, and restored after a loss of the store, once
    it is off.  A taken entry's marker outlives any copy of it still on its way: an hour,
    or the broker's visibility timeout (a redelivery) if longer."""
    if not _beside(config):
        return None
    ttl_ms = int(max(KEPT_MARKER_S, config.visibility_timeout + 60) * 1000)
    if config.broker_amqp:
        options = {**(app.conf.broker_transport_options or {}), "confirm_publish": True}
        store = config.connect(socket_timeout=5, socket_connect_timeout=2,
                               health_check_interval=30)
        return LoggedKeeper(store, lambda: app.connection_for_write().clone(
            transport_options=options), config.prefix, marker_ttl_ms=ttl_ms)
    client = connect(cast(str, config.broker_redis_url), socket_timeout=5,
                     socket_connect_timeout=2, health_check_interval=30)
    return Keeper(cast(redis.Redis, client), config.prefix, marker_ttl_ms=ttl_ms)


def _broker_id(url: str | None) -> str | None:
    """The broker's Redis server id (``run_id``); None if it is not one or cannot be read."""
    if url is None:
        return None
    try:
        client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            ids = server_ids(client)
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return None  # not provably the same server: judged on the store's own persistence
    return ids.pop() if len(ids) == 1 else None


def forget(app: Celery) -> None:
    """Drop ``app``'s runtime in this process (at shutdown), closing its client.

    The runtime of the process this one was forked from is left as it is (its client
    is that process's): :func:`runtime_for` builds this process's own in its place,
    keeping its store's verdict, so that a pool process a node forks (a recycled one's
    replacement) asks the store nothing about its configuration until the node's own
    verdict is due again.
    """
    with _lock:
        rt = _cache.get(app)
        if rt is None or rt.pid != os.getpid():
            return
        del _cache[app]
    rt.counts.stop()  # the counts of the last second, while the client is open
    rt.gate.client.close()
    if rt.room.keeper is not None:
        rt.room.keeper.close()
