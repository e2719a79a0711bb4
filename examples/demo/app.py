"""The demo's Celery app: the same provider call, throttled two ways.

Configured from the environment by the demo runner (or docker-compose):
DEMO_REDIS (server URL; broker db 0, results db 1, throttle db 2),
DEMO_PROVIDER (the mock provider's URL) and DEMO_RATE (e.g. "9/s").
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task

import celery_throttle
from celery_throttle import HEADER, throttled
from examples import provider

REDIS = os.environ.get("DEMO_REDIS", "redis://127.0.0.1:6379")
PROVIDER = os.environ.get("DEMO_PROVIDER", "http://127.0.0.1:8080")
RATE = os.environ.get("DEMO_RATE", "9/s")

app = Celery("demo", broker=f"{REDIS}/0", backend=f"{REDIS}/1")
app.conf.update(
    throttle_redis_url=f"{REDIS}/2",  # a database of its own: see the README on eviction
    broker_connection_retry_on_startup=True,
    result_expires=3600,
)
celery_throttle.install(app)


def call_provider(task: Task[Any, Any], prompt: str) -> dict[str, Any]:
    """POST the prompt; on 429, retry after the provider's Retry-After (what users do today)."""
    try:
        body = provider.summarize(PROVIDER, prompt)
    except provider.RateLimited as exc:
        raise task.retry(countdown=exc.retry_after) from None
    header = (task.request.headers or {}).get(HEADER) or {}
    return {"tokens": body["usage"]["total_tokens"], "retries": task.request.retries,
            "deferrals": header.get("deferrals", 0), "finished": time.time()}


@throttled(RATE, name="provider")
@app.task(bind=True, max_retries=100)
def summarize_throttled(self: Task[Any, Any], prompt: str) -> dict[str, Any]:
    """One provider call, kept under the quota by celery_throttle across all workers."""
    return call_provider(self, prompt)


@app.task(bind=True, max_retries=100, rate_limit=RATE)
def summarize_rate_limited(self: Task[Any, Any], prompt: str) -> dict[str, Any]:
    """The same call under Celery's built-in rate_limit (enforced per worker node)."""
    return call_provider(self, prompt)
