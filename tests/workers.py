"""Integration-test glue: the test app's workers and its start records."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import WorkerProcess, workers

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def cluster(redis_base: str, names: tuple[str, ...] = ("w1", "w2"), *, pool: str = "prefork",
            concurrency: int = 4, env: dict[str, str] | None = None
            ) -> Iterator[list[WorkerProcess]]:
    """Worker nodes of tests.celery_app on every test queue, against ``redis_base``."""
    with workers("tests.celery_app", names, pool=pool, concurrency=concurrency,
                 queues=("celery", "ext", "bursty"), cwd=ROOT,
                 env={"CT_REDIS": redis_base, "PYTHONPATH": str(ROOT), **(env or {})}) as nodes:
        yield nodes


def logs(nodes: list[WorkerProcess]) -> str:
    """All nodes' logs, concatenated."""
    return "\n".join(n.log_text() for n in nodes)


def read_records(client: redis.Redis, *, expect: int, timeout: float) -> list[dict[str, Any]]:
    """Wait (bounded) until ``expect`` start records exist, then return them sorted by time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and client.llen("records") < expect:
        time.sleep(0.1)
    rows = [json.loads(r) for r in client.lrange("records", 0, -1)]
    return sorted(rows, key=lambda r: r["t"])
