"""LangChain's ``rate_limiter=`` on the gate: a team's chat-model calls share one quota.

LangChain chat models take a ``rate_limiter`` (langchain-core's
``BaseRateLimiter``) and call its ``acquire``/``aacquire`` before each
request.  :class:`GateRateLimiter` answers them from Redis with the gate,
so calls made in web code, notebooks and Celery tasks (``@throttled`` with
the same limit name) are counted against one bucket, not one per process as
``InMemoryRateLimiter`` does.  Install with the ``langchain`` extra.

A ``BaseRateLimiter`` is told when a call starts, never when it ends, so it
carries rate limits only: calls in flight (``Concurrency``) need
:meth:`Gate.slot` around the call instead.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.rate_limiters import BaseRateLimiter

from .core.async_gate import AsyncGate
from .core.gate import Gate
from .core.limits import Limit
from .core.rates import Rate, parse_rate

__all__ = ["GateRateLimiter"]


class GateRateLimiter(BaseRateLimiter):
    """A LangChain rate limiter over the gate: ``rate`` under limit ``name``, shared by all.

    ``url``: the throttle's Redis (the workers' ``throttle_redis_url``), and
    ``prefix`` their ``throttle_prefix``; or pass ``gate`` / ``async_gate``
    made elsewhere.  ``timeout``: a blocking acquire that would wait longer
    raises :class:`~celery_throttle.ThrottleTimeout` (booking nothing).
    """

    def __init__(self, rate: str | Rate, *, name: str, burst: int = 1, cost: int = 1,
                 key: object = None, url: str | None = None, prefix: str = "throttle",
                 gate: Gate | None = None, async_gate: AsyncGate | None = None,
                 timeout: float | None = None) -> None:
        if url is None and gate is None and async_gate is None:
            raise ValueError("give url (the throttle's Redis), gate or async_gate")
        self.limits = [Limit(name, parse_rate(rate), burst, key, cost)]
        self.url, self.prefix, self.timeout = url, prefix, timeout
        self._gate = gate
        self._async_gate = async_gate
        # A redis.asyncio client belongs to the loop it first ran on: one per loop
        # (notebooks and scripts call asyncio.run more than once).
        self._loop_gates: dict[int, tuple[asyncio.AbstractEventLoop, AsyncGate]] = {}

    def acquire(self, *, blocking: bool = True) -> bool:
        """Before a sync call: wait for its start (``blocking``), or say whether it may go."""
        gate = self._sync_gate()
        if not blocking:
            return gate.acquire_many(self.limits).allowed
        gate.wait(self.limits, timeout=self.timeout)
        return True

    async def aacquire(self, *, blocking: bool = True) -> bool:
        """Before an async call: the same, awaiting."""
        gate = self._gate_for_loop()
        if not blocking:
            return (await gate.acquire_many(self.limits)).allowed
        await gate.wait(self.limits, timeout=self.timeout)
        return True

    def close(self) -> None:
        """Close the sync gate's client, if this limiter made it."""
        if self._gate is not None and self.url is not None:
            self._gate.client.close()
            self._gate = None

    async def aclose(self) -> None:
        """Close the async client this limiter made for the running loop (call it before the
        loop ends, e.g. at the end of the coroutine ``asyncio.run`` runs)."""
        held = self._loop_gates.pop(id(asyncio.get_running_loop()), None)
        if held is not None:
            await held[1].aclose()

    def _sync_gate(self) -> Gate:
        if self._gate is None:
            if self.url is None:
                raise ValueError("a sync acquire needs url or gate")
            self._gate = Gate.from_url(self.url, prefix=self.prefix)
        return self._gate

    def _gate_for_loop(self) -> AsyncGate:
        if self._async_gate is not None:
            return self._async_gate
        if self.url is None:
            raise ValueError("an async acquire needs url or async_gate")
        loop = asyncio.get_running_loop()
        held = self._loop_gates.get(id(loop))
        if held is None or held[0] is not loop:
            held = (loop, AsyncGate.from_url(self.url, prefix=self.prefix))
            self._loop_gates = {k: v for k, v in self._loop_gates.items()
                                if not v[0].is_closed()}
            self._loop_gates[id(loop)] = held
        return held[1]

    def __repr__(self) -> str:
        limit = self.limits[0]
        return f"GateRateLimiter({limit.rate.text!r}, name={limit.name!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("GateRateLimiter holds Redis clients: make one per process")
