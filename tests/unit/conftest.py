"""Fixtures of the unit tests alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def store() -> Iterator[redis.Redis]:
    """A client of a throttle store of its own that keeps nothing on disk: a test may kill it
    and start it again empty (``tests.servers.restart_empty``)."""
    from celery_throttle.testing import RedisServer

    with RedisServer() as server:
        client = redis.Redis.from_url(f"{server.url}/0")
        client.server = server  # type: ignore[attr-defined]  # (killed and started by tests)
        yield client
        client.close()
