"""AsyncGate in real asyncio code (the shared gate tests run it through tests/aio.py too)."""

from __future__ import annotations

import asyncio
from typing import cast

import redis
import redis.asyncio as aioredis

from celery_throttle import AsyncGate, Gate, Limit, parse_rate
from celery_throttle.core.packed import IDLE_CONNECTIONS


def test_hundred_concurrent_coroutines_pass_exactly_the_burst(redis_url: str,
                                                             prefix: str) -> None:
    """The check-then-act race, in asyncio: 100 coroutines at once on '5/s' burst 5 -> exactly 5."""
    redis.Redis.from_url(redis_url).script_flush()  # the first calls meet NOSCRIPT too

    async def main() -> tuple[list[bool], int]:
        gate = AsyncGate.from_url(redis_url, prefix=prefix)
        try:
            decisions = await asyncio.gather(
                *(gate.acquire("api", "5/s", burst=5) for _ in range(100)))
            kept = len(cast(aioredis.Redis, gate.client).connection_pool._in_use_connections)
            return [d.allowed for d in decisions], kept
        finally:
            await gate.aclose()

    allowed, kept = asyncio.run(main())
    assert allowed.count(True) == 5
    # It keeps a few connections for the next decisions, and gives the pool back the rest
    # (redis-py's pool holds 100: a gate keeping them all would starve the claims).
    assert kept <= IDLE_CONNECTIONS


def test_async_and_sync_gates_share_one_bucket(redis_url: str, client: redis.Redis,
                                               prefix: str) -> None:
    """A web handler on AsyncGate and a worker on Gate spend the same quota."""
    limit = Limit("shared", parse_rate("1/s"))
    assert Gate(client, prefix=prefix).acquire_many([limit]).allowed

    async def web() -> float:
        gate = AsyncGate.from_url(redis_url, prefix=prefix)
        try:
            decision = await gate.acquire_many([limit])
            assert not decision.allowed
            return decision.retry_after
        finally:
            await gate.aclose()

    assert 0.9 < asyncio.run(web()) <= 1.0
