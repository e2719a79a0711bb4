"""The tasks of ``benchmarks/fairness.py``, run by real worker processes.

Two limits at the same rate: ``fair``, shared by tenants and served by turns
(weights a 3, b 2, the others 1), and ``ranked``, whose line is ordered by
priority.  Every start is recorded, with when its task was sent and how many
times it waited outside the worker (each such wait is one more publish), in a
Redis database of its own.

Configured from the environment: FAIR_BROKER (the broker URL), FAIR_REDIS
(a Redis server URL: the store on db 2, the records on db 4), FAIR_RATE (both
limits, e.g. ``"20/s"``).
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

REDIS = os.environ.get("FAIR_REDIS", "redis://127.0.0.1:6379")
RATE = os.environ.get("FAIR_RATE", "20/s")
WEIGHTS = {"a": 3, "b": 2}

app = Celery("fair", broker=os.environ.get("FAIR_BROKER", f"{REDIS}/1"))
app.conf.update(
    task_ignore_result=True,
    task_queue_max_priority=10,  # (RabbitMQ: a queue orders by priority only when declared so)
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    throttle_redis_url=f"{REDIS}/2",
    throttle_fair_weights={"fair": WEIGHTS},
)
celery_throttle.install(app)

_records = redis.Redis.from_url(f"{REDIS}/4")


def _record(task: Task[Any, Any], **fields: Any) -> None:
    header = (task.request.headers or {}).get(HEADER) or {}
    _records.rpush("starts", json.dumps({"t": time.time(), "id": task.request.id,
                                         "waited": header.get("deferrals", 0), **fields}))


@throttled(RATE, name="fair", fair="tenant")
@app.task(bind=True)
def shared(self: Task[Any, Any], tenant: str, sent: float) -> None:
    """A start of the fair limit."""
    _record(self, tenant=tenant, sent=sent)


@throttled(RATE, name="ranked")
@app.task(bind=True)
def ranked(self: Task[Any, Any], kind: str, sent: float) -> None:
    """A start of the limit ordered by priority."""
    _record(self, kind=kind, sent=sent)
