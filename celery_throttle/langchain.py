"""LangChain's ``rate_limiter=`` on the gate: a team's chat-model calls share one quota.

LangChain chat models take a ``rate_limiter`` (langchain-core's
``BaseRateLimiter``) and call its ``acquire``/``aacquire`` before each
request.  :class:`GateRateLimiter` answers them from Redis with the gate,
so calls made in web code, notebooks and Celery tasks (``@throttled`` with
the same limit name) are counted against one bucket, not one per process as
``InMemoryRateLimiter`` does.  Install with the ``langchain`` extra.

A ``BaseRateLimiter`` is told when a call starts, never when it ends, so it
carries rate limits only: calls in flight (``Concurrency``) need
:meth:`Gate.admitted` around the call instead.  It is asked once per model call,
before the model builds its request: it does not see the SDK's own retries
of that request (the ``openai`` and ``anthropic`` SDKs retry twice by
default), nor the time between its answer and the request.  A model that
takes an ``http_client`` (``ChatOpenAI``, ``ChatAnthropic``) is gated on
every request it sends by ``celery_throttle.transport.gated_client``
instead.
"""

from __future__ import annotations

from typing import Any

from langchain_core.rate_limiters import BaseRateLimiter

from .core.async_gate import AsyncGate, LoopGates
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
        self._loop_gates = LoopGates(url, prefix) if url is not None else None

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
        if self._loop_gates is not None:
            await self._loop_gates.aclose()

    def _sync_gate(self) -> Gate:
        if self._gate is None:
            if self.url is None:
                raise ValueError("a sync acquire needs url or gate")
            self._gate = Gate.from_url(self.url, prefix=self.prefix)
        return self._gate

    def _gate_for_loop(self) -> AsyncGate:
        if self._async_gate is not None:
            return self._async_gate
        if self._loop_gates is None:
            raise ValueError("an async acquire needs url or async_gate")
        return self._loop_gates.get()

    def __repr__(self) -> str:
        limit = self.limits[0]
        return f"GateRateLimiter({limit.rate.text!r}, name={limit.name!r})"

    def __deepcopy__(self, memo: dict[int, Any]) -> GateRateLimiter:
        # LangChain deep-copies models (model_copy(deep=True), with_config...):
        # every copy of a model spends the same quota, so it keeps this limiter.
        return self

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("GateRateLimiter holds Redis clients: make one per process")
