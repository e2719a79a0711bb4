"""An LLM gateway's worker: four limits on one task, passed together (all or nothing).

* each tenant (API customer) may start 2 calls per second: ``key="tenant"``;
* all tenants together stay under the provider's request quota: 8/s;
* and under its cap on calls in flight: 4 at once (``concurrency=4``), each
  call holding a lease that a killed worker gives back within 30 s;
* and under its token budget: 400 tokens/s.  The true token count is known
  only from the provider's answer, so the call is charged an estimate
  (``cost=estimate_tokens``) and settled with the real usage afterwards.

A 429 from the provider (``RateLimited``) pauses these limits on every
worker for its Retry-After, and the call is re-scheduled, retries untouched.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, Task

import celery_throttle
from celery_throttle import throttled
from examples import provider

REDIS = os.environ.get("LLM_REDIS", "redis://127.0.0.1:6379")
PROVIDER = os.environ.get("LLM_PROVIDER", "http://127.0.0.1:8080")
CALL_SECONDS = 1.0  # how long the provider takes to answer: 6 calls would be in flight

app = Celery("llm_quota", broker=f"{REDIS}/3", backend=f"{REDIS}/4")
app.conf.update(throttle_redis_url=f"{REDIS}/5", broker_connection_retry_on_startup=True,
                worker_prefetch_multiplier=1)
celery_throttle.install(app)


def estimate_tokens(tenant: str, prompt: str) -> int:
    """Charged before the call: a rough guess (the provider counts len(prompt) // 4)."""
    return max(1, len(prompt) // 3)


@throttled("2/s", key="tenant", name="llm-tenant")
@throttled("8/s", concurrency=4, name="llm-requests")
@throttled("400/s", name="llm-tokens", burst=400, cost=estimate_tokens)
@app.task(bind=True, max_retries=5)
def summarize(self: Task[Any, Any], tenant: str, prompt: str) -> dict[str, Any]:
    """Call the provider once and settle the token charge with its real usage."""
    try:
        body = provider.summarize(PROVIDER, prompt, work=CALL_SECONDS)
    except provider.RateLimited as exc:
        # Every worker holds off for Retry-After; this call comes back after it.
        raise celery_throttle.RateLimited(exc.retry_after) from None
    used = int(body["usage"]["total_tokens"])
    celery_throttle.settle(used, limit="llm-tokens")
    return {"tenant": tenant, "tokens": used, "retries": self.request.retries}
