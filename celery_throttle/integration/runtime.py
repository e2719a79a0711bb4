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

from celery import Celery

from ..core.gate import Gate
from ..core.live import LiveLimits
from ..core.logs import Every
from ..room.parking import WaitingRoom
from .config import Config, read_config
from .copies import CopyPointer

__all__ = ["INSTALLED", "Runtime", "forget", "runtime_for"]

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
    pid: int
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
            rt = Runtime(config, Gate(client, prefix=config.prefix),
                         WaitingRoom(client, config.prefix, replicas=config.park_replicas),
                         CopyPointer(client, config.prefix, config.visibility_timeout
                                     + config.horizon + 60),
                         LiveLimits(client, config.prefix), os.getpid())
            _cache[app] = rt
        return rt


def forget(app: Celery) -> None:
    """Drop ``app``'s runtime in this process (after fork, at shutdown), closing its client."""
    with _lock:
        rt = _cache.pop(app, None)
    if rt is not None and rt.pid == os.getpid():
        rt.gate.client.close()
