"""An LLM gateway's worker: three limits on one task, passed together (all or nothing).

* each tenant (API customer) may start 2 calls per second: ``key="tenant"``;
* all tenants together stay under the provider's request quota: 8/s;
* and under its token budget: 400 tokens/s, a call costing len(prompt)//4 tokens.
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

app = Celery("llm_quota", broker=f"{REDIS}/3", backend=f"{REDIS}/4")
app.conf.update(throttle_redis_url=f"{REDIS}/5", broker_connection_retry_on_startup=True)
celery_throttle.install(app)


def tokens(tenant: str, prompt: str) -> int:
    """The token estimate charged before the call."""
    return max(1, len(prompt) // 4)


@throttled("2/s", key="tenant", name="llm-tenant")
@throttled("8/s", name="llm-requests")
@throttled("400/s", name="llm-tokens", burst=400, cost=tokens)
@app.task(bind=True, max_retries=5)
def summarize(self: Task[Any, Any], tenant: str, prompt: str) -> dict[str, Any]:
    """Call the provider once; a 429 here would mean the limits were wrong."""
    try:
        body = provider.summarize(PROVIDER, prompt)
    except provider.RateLimited as exc:
        raise self.retry(countdown=exc.retry_after) from None
    return {"tenant": tenant, "tokens": body["usage"]["total_tokens"]}
