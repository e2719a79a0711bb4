"""The soak's tasks (``benchmarks/soak.py``), run by real worker processes.

Three limits under over-limit traffic: ``soak-rate`` at 10/s (priorities
mixed), ``soak-tenant`` at 2/s per tenant, and ``soak-seats``, at most 3 runs
at once of a task that takes 0.3 s.  Every run records its start and, once its
body is done, its end, in a Redis the soak never kills; the runner judges from
those records alone.

Configured from the environment: SOAK_BROKER (the broker URL), SOAK_STORE
(the throttle's store), SOAK_RECORDS (the records and results server),
SOAK_THROTTLE ("0": the same tasks without ``@throttled``, Celery alone),
SOAK_VISIBILITY (the broker's visibility timeout, seconds; 20 by default),
SOAK_PREFETCH (``worker_prefetch_multiplier``; Celery's own, 4, by default).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from celery import Celery, Task

import celery_throttle
from celery_throttle import throttled

T = TypeVar("T")

RATE, TENANT_RATE, SEATS, SEAT_SECONDS = 10, 2, 3, 0.3
THROTTLE = os.environ.get("SOAK_THROTTLE", "1") == "1"
RECORDS = os.environ.get("SOAK_RECORDS", "redis://127.0.0.1:6379")
VISIBILITY = float(os.environ.get("SOAK_VISIBILITY", "20"))
PREFETCH = int(os.environ.get("SOAK_PREFETCH", "4"))

app = Celery("soak", broker=os.environ.get("SOAK_BROKER", f"{RECORDS}/0"),
             backend=f"{RECORDS}/1")
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=PREFETCH,
    task_reject_on_worker_lost=True,
    # A stranded message (its node killed) comes back after the visibility
    # timeout; the sweep looks every sixth of it, so the drain stays bounded.
    broker_transport_options={"visibility_timeout": VISIBILITY,
                              "unacked_restore_interval": VISIBILITY / 6,
                              "confirm_publish": True},
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=False,
    throttle_redis_url=os.environ.get("SOAK_STORE", f"{RECORDS}/2"),
)
if THROTTLE:
    celery_throttle.install(app)

_records = redis.Redis.from_url(f"{RECORDS}/3")


def gated(*args: Any, **kwargs: Any) -> Callable[[T], T]:
    """``@throttled(...)``, or nothing for the run without the throttle."""
    return throttled(*args, **kwargs) if THROTTLE else (lambda task: task)


def _record(task: Task[Any, Any], kind: str, what: str) -> None:
    _records.rpush(f"soak:{what}", json.dumps({
        "t": time.time(), "id": task.request.id, "kind": kind,
        "node": task.request.hostname, "pid": os.getpid()}))


@gated(f"{RATE}/s", name="soak-rate")
@app.task(bind=True)
def rated(self: Task[Any, Any], i: int) -> int:
    """A start of the rate limit."""
    _record(self, "rate", "start")
    _record(self, "rate", "end")
    return i


@gated(f"{TENANT_RATE}/s", key="tenant", name="soak-tenant")
@app.task(bind=True)
def per_tenant(self: Task[Any, Any], i: int, tenant: str) -> int:
    """A start of one tenant's limit."""
    _record(self, f"tenant:{tenant}", "start")
    _record(self, f"tenant:{tenant}", "end")
    return i


@gated(concurrency=SEATS, name="soak-seats")
@app.task(bind=True)
def seats(self: Task[Any, Any], i: int) -> int:
    """A run that holds one of the limit's seats for SEAT_SECONDS."""
    _record(self, "seats", "start")
    time.sleep(SEAT_SECONDS)
    _record(self, "seats", "end")
    return i
