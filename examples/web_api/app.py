"""The Celery side of the web example: a task that calls the provider under limit "provider".

The web app (``web.py``) spends the same limit, by the same name, from its
request handlers; the provider sees one combined rate.  Configured from the
environment by the runner: WEB_REDIS (server URL; broker db 3, results db
4, throttle db 5) and WEB_PROVIDER (the mock provider's URL).
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_throttle
from celery_throttle import throttled
from examples import provider

REDIS = os.environ.get("WEB_REDIS", "redis://127.0.0.1:6379")
PROVIDER = os.environ.get("WEB_PROVIDER", "http://127.0.0.1:8080")
THROTTLE_STORE = f"{REDIS}/5"
#: The provider allows 10 requests in any 1 s; both sides together stay under 8/s.
LIMIT_NAME, RATE = "provider", "8/s"

app = Celery("web_api", broker=f"{REDIS}/3", backend=f"{REDIS}/4")
app.conf.update(throttle_redis_url=THROTTLE_STORE, broker_connection_retry_on_startup=True)
celery_throttle.install(app)


@throttled(RATE, name=LIMIT_NAME)
@app.task
def summarize(doc: str) -> float:
    """Summarize ``doc`` at the provider; returns when the call started."""
    started = time.time()
    provider.summarize(PROVIDER, doc)
    return started
