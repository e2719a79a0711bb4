"""The app of ``benchmarks/pools.py``: one limited task, run on each kind of pool.

Kept apart from ``bench_app`` (which imports the SDKs at load) so that a
gevent or eventlet worker loads nothing but Celery and this package after
patching.  Configured from the environment: POOLS_REDIS (server URL; broker
db 1, store db 2, results db 3, records db 4), POOLS_RATE (per second),
POOLS_WORK (seconds of I/O per task after its start), POOLS_SEATS (the limit's
concurrency too; unset: none) and
POOLS_MAX_TASKS_PER_CHILD (prefork's recycling; unset: none) and POOLS_POOL_CHECK
(``throttle_pool_check_interval``; unset: its default).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

import celery_throttle
from celery_throttle import HEADER, throttled

REDIS = os.environ.get("POOLS_REDIS", "redis://127.0.0.1:6379")
RATE = int(os.environ.get("POOLS_RATE", "20"))
WORK = float(os.environ.get("POOLS_WORK", "0"))
SEATS = int(os.environ.get("POOLS_SEATS") or 0) or None

app = Celery("pools", broker=f"{REDIS}/1", backend=f"{REDIS}/3")
app.conf.update(throttle_redis_url=f"{REDIS}/2", broker_connection_retry_on_startup=True,
                result_expires=600, worker_hijack_root_logger=False)
if os.environ.get("POOLS_MAX_TASKS_PER_CHILD"):
    app.conf.worker_max_tasks_per_child = int(os.environ["POOLS_MAX_TASKS_PER_CHILD"])
if os.environ.get("POOLS_POOL_CHECK"):
    app.conf.throttle_pool_check_interval = float(os.environ["POOLS_POOL_CHECK"])
celery_throttle.install(app)

_records = redis.Redis.from_url(f"{REDIS}/4")


@throttled(f"{RATE}/s", name="pools", concurrency=SEATS)
@app.task(bind=True)
def call(self: Task[Any, Any], i: int) -> int:
    """Record the start (the provider call), then hold the worker for POOLS_WORK of I/O."""
    header = (self.request.headers or {}).get(HEADER) or {}
    _records.rpush("starts", json.dumps({"t": time.time(), "id": self.request.id,
                                         "pid": os.getpid(),
                                         "deferrals": header.get("deferrals", 0)}))
    if WORK:
        time.sleep(WORK)
    return i


@app.task(bind=True)
def free(self: Task[Any, Any], i: int, sent: float) -> int:
    """No limit (the control): record how long after its publish (``sent``) it started."""
    _records.rpush("starts", json.dumps({"t": time.time(), "id": self.request.id,
                                         "pid": os.getpid(), "deferrals": 0,
                                         "late": time.time() - sent}))
    return i
