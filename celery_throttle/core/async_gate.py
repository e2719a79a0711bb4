"""The gate for asyncio code (FastAPI, Starlette, aiohttp): :class:`AsyncGate`.

The same decisions as :class:`~celery_throttle.Gate`, on a ``redis.asyncio``
client: the same script (one copy of the algorithm), the same arguments and
the same replies (:class:`~celery_throttle.core.gate.GateCalls` builds and
reads them for both), and the same packed hot path (``packed.py``).  A web
handler and the Celery workers beside it spend one quota.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from ..values import LONGEST_WAIT, to_us
from . import stops, waiting
from .calls import COMMANDS, Clock, F, GateCalls
from .connect import connect_async
from .keys import stop_field, stops_key
from .limits import (
    DEFAULT_LEASE,
    AnyLimit,
    BucketState,
    Concurrency,
    Decision,
    LeaseState,
    Limit,
    Reservation,
    declared,
)
from .packed import AsyncPackedPath
from .rates import Rate, parse_rate

__all__ = ["AsyncGate", "LoopGates"]


class AsyncGate(GateCalls):
    """:class:`~celery_throttle.Gate` on ``redis.asyncio``: every method is a coroutine.

    ``clock`` as for the sync gate: ``"server"`` (Redis' ``TIME``, the
    default), ``"local"`` or a callable returning seconds.
    """

    def __init__(self, client: aioredis.Redis | AsyncRedisCluster, *, prefix: str = "throttle",
                 clock: Clock = "server", packed: bool = True) -> None:
        super().__init__(prefix, clock)
        self.client = client
        # redis-py's AsyncScript: EVALSHA, and the body again on NOSCRIPT.
        self._scripts = {name: client.register_script(text) for name, text in COMMANDS.items()}
        if packed and AsyncPackedPath.takes(client):
            self._packed = AsyncPackedPath(cast(aioredis.Redis, client), COMMANDS["decide"],
                                           self._scripts["decide"].sha)

    @classmethod
    def from_url(cls, url: str, *, master_name: str | None = None,
                 **options: Any) -> AsyncGate:
        """A gate on a new ``redis.asyncio`` client for ``url`` (the forms of
        :meth:`Gate.from_url <celery_throttle.Gate.from_url>`)."""
        return cls(connect_async(url, master_name=master_name), **options)

    async def preload(self) -> None:
        """Load the commands' scripts now, so the first call of each is a plain EVALSHA."""
        for text in COMMANDS.values():
            await self.client.script_load(text)

    async def acquire(self, name: str, rate: str | Rate, *, burst: int = 1,
                      key: object = None, cost: int = 1) -> Decision:
        """Try to start one job under a single limit; charged only if allowed."""
        return await self.acquire_many([Limit(name, parse_rate(rate), burst, key, cost)])

    async def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = None,
                           claim: Reservation | None = None, grace: float = 0.0,
                           holder: str = "", in_line: bool = False,
                           near: float = 0.0) -> Decision:
        """Pass every limit at once, or none of them (see :meth:`Gate.acquire_many`)."""
        plain = self._plain(limits, reserve, grace, claim, holder, in_line, near)
        if plain is not None:
            reply = await cast(AsyncPackedPath, self._packed).send(plain)
            if reply is not None:
                return self._decision(limits, reply)
        keys, args = self._decide_call(limits, reserve, claim, grace, holder, in_line, near)
        return self._decision(limits, await self._run("decide", keys, args))

    async def wait(self, limits: Sequence[AnyLimit], *, timeout: float | None = None,
                   holder: str = "", grace: float = waiting.DEFAULT_GRACE) -> Decision:
        """Wait for one start (see :meth:`Gate.wait`); a cancelled waiter gives its booking
        back."""
        return await waiting.await_start(self, limits, timeout=timeout, holder=holder,
                                        grace=grace)

    def admitted(self, limits: Sequence[AnyLimit], *, timeout: float | None = None,
             holder: str | None = None) -> contextlib.AbstractAsyncContextManager[Decision]:
        """``async with gate.admitted(limits):`` wait for a start, run the block; leases are
        renewed by a task while it runs and given back when it exits."""
        return waiting.ahold(self, limits, timeout=timeout, holder=holder)

    def limit(self, rate: str | Rate | None = None, *, name: str, burst: int = 1,
              cost: int = 1, key: object = None, concurrency: int | None = None,
              lease: float = DEFAULT_LEASE,
              timeout: float | None = None) -> Callable[[F], F]:
        """Decorate a coroutine function: every call awaits a start (see :meth:`Gate.limit`)."""
        return waiting.limited(
            self, declared(name, rate, burst, key, cost, concurrency, lease), timeout)

    async def release(self, limits: Sequence[AnyLimit], holder: str,
                      ran_for: float = 0.0) -> int:
        """Give back ``holder``'s leases (see :meth:`Gate.release`)."""
        return int(await self._run("release", *self._release_call(limits, holder, to_us(ran_for))))

    async def extend(self, limits: Sequence[AnyLimit], holder: str) -> int:
        """Renew ``holder``'s leases; returns how many are lost (see :meth:`Gate.extend`)."""
        return int(await self._run("renew", *self._call(limits, holder)))

    async def pause(self, limits: Sequence[AnyLimit], seconds: float, *,
                    refused_after: float | None = None) -> float:
        """Admit nothing in ``limits`` for ``seconds``; a refusal cuts the learned rates
        (see :meth:`Gate.pause`)."""
        return self._pause_reply(limits, await self._run(
            "pause", *self._pause_call(limits, seconds, refused_after)))

    async def stop(self, limits: Sequence[AnyLimit], reason: str, message: str) -> bool:
        """Stop ``limits`` until resumed, for ``reason`` (see :meth:`Gate.stop`)."""
        already = await self.stopped(limits)
        await self.pause(limits, LONGEST_WAIT)
        records = {stop_field(lim.name, lim.key): stops.dumps(stops.record(lim, reason, message))
                   for lim in limits}
        await self.client.hset(stops_key(self.prefix), mapping=records)  # type: ignore[arg-type]
        return already is None

    async def stopped(self, limits: Sequence[AnyLimit]) -> stops.Stop | None:
        """Why ``limits`` are stopped (see :meth:`Gate.stopped`)."""
        if not limits:
            return None
        raws = await self.client.hmget(stops_key(self.prefix),
                                     [stop_field(lim.name, lim.key) for lim in limits])
        return stops.first(raws)

    async def resume(self, limits: Sequence[AnyLimit]) -> int:
        """End a pause of ``limits`` now, a stop too (see :meth:`Gate.resume`)."""
        ended = int(await self._run("resume", *self._paused_call(limits)))
        if limits:
            await self.client.hdel(stops_key(self.prefix),
                                   *[stop_field(lim.name, lim.key) for lim in limits])
        return ended

    async def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int:
        """Give back an unused booking (see :meth:`Gate.cancel`)."""
        return int(await self._run("cancel", *self._cancel_call(limits, booking)))

    async def settle(self, limit: Limit, actual: int, *, charged: int | None = None) -> None:
        """Correct ``limit``'s charge to the ``actual`` units (see :meth:`Gate.settle`)."""
        call = self._settle_call(limit, actual, charged)
        if call is not None:
            await self._run("settle", *call)

    async def follow(self, limits: Sequence[AnyLimit], remaining: int, reset: float) -> int:
        """:meth:`Gate.follow <celery_throttle.Gate.follow>`: spend at most ``remaining`` units
        before the provider's ``reset``."""
        call = self._follow_call(limits, remaining, reset)
        if call is None:
            return 0
        return int(await self._run("follow", *call))

    async def inspect(self, limit: Limit) -> BucketState:
        """Read ``limit``'s bucket without charging it (see :meth:`Gate.inspect`)."""
        keys, args = self._inspect_call(limit)
        return self._bucket_state(limit, await self._run("inspect", keys, args))

    async def inspect_leases(self, limit: Concurrency) -> LeaseState:
        """Count ``limit``'s unexpired leases and read its pause."""
        keys, args = self._inspect_call(limit)
        return self._lease_state(limit, await self._run("inspect", keys, args))

    async def reset(self, limit: AnyLimit) -> bool:
        """Forget ``limit``'s bucket (see :meth:`Gate.reset`)."""
        return bool(await self.client.delete(*self._reset_keys(limit)))

    async def aclose(self) -> None:
        """Close the client (its connection pool), and the connections the gate keeps."""
        if isinstance(self._packed, AsyncPackedPath):
            await self._packed.close()
        await self.client.aclose()

    async def __aenter__(self) -> AsyncGate:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, command: str, keys: list[bytes], args: list[bytes]) -> Any:
        """Run the gate's ``command`` (its script: EVALSHA, the body again on NOSCRIPT)."""
        return await self._scripts[command](keys=keys, args=args)


class LoopGates:
    """An :class:`AsyncGate` on ``url`` for each event loop that asks (:meth:`get`).

    A ``redis.asyncio`` client belongs to the loop that first used it, and
    notebooks and scripts call ``asyncio.run`` more than once: an adapter
    that is handed a URL keeps one gate per loop, forgetting closed loops'.
    """

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self._gates: dict[int, tuple[asyncio.AbstractEventLoop, AsyncGate]] = {}

    def get(self) -> AsyncGate:
        """The running loop's gate (made on first use)."""
        loop = asyncio.get_running_loop()
        held = self._gates.get(id(loop))
        if held is None or held[0] is not loop:
            held = (loop, AsyncGate.from_url(self.url, prefix=self.prefix))
            self._gates = {k: v for k, v in self._gates.items() if not v[0].is_closed()}
            self._gates[id(loop)] = held
        return held[1]

    async def aclose(self) -> None:
        """Close the running loop's gate, if one was made (call it before the loop ends)."""
        held = self._gates.pop(id(asyncio.get_running_loop()), None)
        if held is not None:
            await held[1].aclose()
