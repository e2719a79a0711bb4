"""The Celery app that integration tests run in real worker processes.

Every task records its start (time, id, retries, deferrals, pid) in a Redis
list; tests judge only from those records and from the result backend.
Configured from the environment: CT_REDIS (server URL; broker on db 10, store
on db 11, results on db 12, records on db 13: high numbers, since the tests
flush them) and CT_PREFIX (the bucket prefix).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task, current_task, shared_task

import celery_throttle
from celery_throttle import HEADER, throttled

REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
RECORDS_KEY = "records"

app = Celery("ct_tests", broker=f"{REDIS}/10", backend=f"{REDIS}/12")
app.conf.update(
    throttle_redis_url=os.environ.get("CT_STORE") or f"{REDIS}/11",
    throttle_prefix=os.environ.get("CT_PREFIX", "throttle"),
    throttle_queues={"ext": "10/s", "bursty": {"rate": "10/s", "burst": 3}},
    broker_connection_retry_on_startup=True,
    task_default_queue="celery",
    result_expires=600,
)
if os.environ.get("CT_MAX_SLEEP"):
    app.conf.throttle_max_sleep = float(os.environ["CT_MAX_SLEEP"])
if os.environ.get("CT_GRACE"):
    app.conf.throttle_claim_grace = float(os.environ["CT_GRACE"])
if os.environ.get("CT_ON_ERROR"):
    app.conf.throttle_on_error = os.environ["CT_ON_ERROR"]
if os.environ.get("CT_MAX_COUNTDOWN"):
    app.conf.throttle_max_countdown = float(os.environ["CT_MAX_COUNTDOWN"])
celery_throttle.install(app)

_records = redis.Redis.from_url(f"{REDIS}/13")


def record(task: Task[Any, Any], **extra: Any) -> None:
    """Append this start to the records list (time first: that is what is judged)."""
    now = time.time()
    header = (task.request.headers or {}).get(HEADER) or {}
    queue = (task.request.delivery_info or {}).get("routing_key")
    _records.rpush(RECORDS_KEY, json.dumps({
        "t": now, "task": task.name, "id": task.request.id, "retries": task.request.retries,
        "deferrals": header.get("deferrals", 0), "slot": header.get("started_slot"),
        "pid": os.getpid(),
        "host": task.request.hostname, "queue": queue, **extra,
    }))


@throttled("20/s")
@app.task(bind=True)
def steady(self: Task[Any, Any], i: int) -> int:
    """One bucket shared by every worker at 20/s."""
    record(self, i=i)
    return i


@throttled("5/s", key="tenant")
@app.task(bind=True)
def per_tenant(self: Task[Any, Any], tenant: str, i: int) -> str:
    """One bucket per tenant at 5/s."""
    record(self, tenant=tenant, i=i)
    return tenant


@throttled("2/s", name="own-slow")
@throttled("10/s", name="shared")
@app.task(bind=True)
def held_by_own(self: Task[Any, Any], i: int) -> int:
    """Held by its own slow limit; must not eat the shared limit while it waits."""
    record(self, i=i)
    return i


@throttled("10/s", name="shared")
@app.task(bind=True)
def sibling(self: Task[Any, Any], i: int) -> int:
    """Uses only the shared limit."""
    record(self, i=i)
    return i


@throttled("10/s", name="openai")
@throttled("200/s", name="openai-tokens", burst=40,
           cost=lambda prompt, **kw: max(1, len(prompt) // 4))
@app.task(bind=True)
def summarize(self: Task[Any, Any], prompt: str) -> int:
    """Stacked request and token limits, passed together."""
    record(self, tokens=max(1, len(prompt) // 4))
    return len(prompt)


@throttled("5/s")
@app.task(bind=True, max_retries=0)
def no_retries(self: Task[Any, Any], i: int) -> int:
    """max_retries=0: waiting for the throttle must not spend retries."""
    record(self, i=i)
    return i


@throttled("2/s")
@app.task(bind=True)
def expiring(self: Task[Any, Any], i: int) -> int:
    """Sent with expires=: must never run after its expiry."""
    record(self, i=i)
    return i


@app.task(bind=True)
def undecorated(self: Task[Any, Any], i: int) -> int:
    """No decorator: limited only by its queue's throttle_queues entry."""
    record(self, i=i)
    return i


@throttled("10/s")
@shared_task
def shared_one(i: int) -> int:
    """A shared_task (not bound) under @throttled."""
    record(current_task, i=i)
    return i


@throttled("1/s", max_wait=1.5)
@app.task(bind=True)
def impatient(self: Task[Any, Any], i: int) -> int:
    """Fails with ThrottleTimeout rather than wait more than 1.5 s."""
    record(self, i=i)
    return i


@throttled("1/2s", name="hops")
@app.task(bind=True)
def long_wait(self: Task[Any, Any], i: int) -> int:
    """Waits several seconds; with a 1 s max countdown that takes several hops."""
    record(self, i=i)
    return i


@throttled("5/s")
@app.task(bind=True, max_retries=3)
def retry_once(self: Task[Any, Any], i: int) -> int:
    """Retries itself at once after its first start: each start must pass the gate anew."""
    record(self, i=i)
    if self.request.retries == 0:
        raise self.retry(countdown=0.01)
    return i
