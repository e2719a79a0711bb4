"""Test glue: the test app's workers, its start records, and a publish recorder."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import WorkerProcess, max_in_window, workers

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def cluster(redis_base: str, names: tuple[str, ...] = ("w1", "w2"), *, pool: str = "prefork",
            concurrency: int = 4, env: dict[str, str] | None = None,
            queues: tuple[str, ...] = ("celery", "ext", "bursty"),
            ) -> Iterator[list[WorkerProcess]]:
    """Worker nodes of tests.celery_app (on every test queue by default), against ``redis_base``."""
    with workers("tests.celery_app", names, pool=pool, concurrency=concurrency,
                 queues=queues, cwd=ROOT,
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


def wait_results(results: list[Any], timeout: float) -> list[str]:
    """Poll (bounded) until every AsyncResult is ready; return their states."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(r.ready() for r in results):
        time.sleep(0.2)
    return [r.state for r in results]


def check_window_bound(
    times: list[float], rate: float, burst: int, period: float
) -> dict[float, int]:
    """Assert no window from a quarter period to five periods exceeds B-1+ceil(w*rate)+1."""
    worst = {}
    for w in (period / 4, period / 2, period, 2 * period, 5 * period):
        allowed = burst - 1 + math.ceil(w * rate - 1e-9) + 1  # +1: scheduling jitter
        seen = max_in_window(times, w)
        worst[w] = seen
        assert seen <= allowed, f"{seen} starts in a {w}s window, bound {allowed}"
    return worst


class PublishRecorder:
    """Stands in for a signature in unit tests: records what would be published."""

    def __init__(self, sink: list[dict[str, Any]], options: dict[str, Any]) -> None:
        self.sink, self.options = sink, options

    def apply_async(self) -> None:
        self.sink.append(self.options)
