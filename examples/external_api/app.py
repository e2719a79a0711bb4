"""Tasks that call a quota-limited API, limited by their queue, with no decorator at all.

``throttle_queues = {"partner-api": "5/s"}`` limits every task consumed from
the ``partner-api`` queue, across all workers, whatever the task.
"""

from __future__ import annotations

import os
import time
import urllib.request

from celery import Celery

import celery_throttle

REDIS = os.environ.get("EXT_REDIS", "redis://127.0.0.1:6379")
PROVIDER = os.environ.get("EXT_PROVIDER", "http://127.0.0.1:8080")

app = Celery("external_api", broker=f"{REDIS}/6", backend=f"{REDIS}/7")
app.conf.update(
    throttle_redis_url=f"{REDIS}/8",
    throttle_queues={"partner-api": "5/s"},
    task_routes={"examples.external_api.app.*": {"queue": "partner-api"}},
    broker_connection_retry_on_startup=True,
)
celery_throttle.install(app)


def call_partner_api() -> float:
    """One call to the partner API; returns when it started."""
    started = time.time()
    with urllib.request.urlopen(f"{PROVIDER}/stats", timeout=10) as response:
        response.read()
    return started


@app.task
def sync_contact(contact_id: int) -> float:
    """One API call per contact."""
    return call_partner_api()


@app.task
def sync_invoice(invoice_id: int) -> float:
    """Another task on the same queue: it shares the queue's 5/s."""
    return call_partner_api()
