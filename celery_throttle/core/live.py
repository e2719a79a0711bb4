"""Live limits: a rate and burst set at run time over the code's (``celery throttle set``).

One hash per prefix, ``{<prefix>}:live``: limit name -> ``"<interval us> <burst>
<rate>"`` (the interval for the dispatch's Lua, ``room/lua/serve.lua``; the rate
as written, parsed here exactly).  An override names a limit, so it applies
to every key value of a per-key limit.

Beside it, ``{<prefix>}:enforce``: limit name -> "1" or "0", a limit switched
in or out of shadow mode at run time (``celery throttle shadow NAME on|off``),
over the code's ``enforce`` and the app's ``throttle_enforce``.

Celery's workers read them at most once per :data:`REFRESH` seconds per process
and decide with the overridden limits (:meth:`LiveLimits.apply`); the
dispatchers read it in the same script call that charges a waiting task.  So
a change reaches every decision within a second, waiting tasks included,
without a round trip on the hot path.  Web code on a :class:`Gate` may apply
it the same way: ``gate.acquire_many(live.apply(limits))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from ..values import positive_int, text
from .keys import enforce_key, live_key, validate_name
from .limits import AnyLimit, Limit
from .rates import Rate, parse_rate

__all__ = ["REFRESH", "LiveLimits"]

#: How old (seconds) a process's copy of the overrides may be.
REFRESH = 1.0


class LiveLimits:
    """The overrides of one key prefix, on one Redis client, with a cached copy.

    ``client``: the sync client :meth:`set`, :meth:`unset`, :meth:`read`
    and :meth:`apply` use; None for asyncio code, which refreshes the copy
    through its own client with :meth:`aapply`.  ``clock``: seconds, for
    the copy's age (tests step it).
    """

    def __init__(self, client: redis.Redis | RedisCluster | None, prefix: str, *,
                 refresh: float = REFRESH,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.clock = clock  # how old the copy is: this process's monotonic clock
        self.key = live_key(prefix)
        self.modes_key = enforce_key(prefix)
        self.refresh = refresh
        self._copy: dict[str, tuple[Rate, int]] = {}
        self._modes: dict[str, bool] = {}
        self._read_at = float("-inf")  # monotonic
        self._lock = threading.Lock()  # threads pools share the copy

    def set(self, name: str, rate: str | Rate, burst: int = 1) -> Rate:
        """Override limit ``name``: ``rate`` with ``burst`` everywhere, until :meth:`unset`."""
        validate_name(name)
        parsed = parse_rate(rate)
        positive_int("burst", burst)
        self._sync().hset(self.key, name, f"{parsed.interval_us} {burst} {parsed}")
        return parsed

    def unset(self, name: str) -> bool:
        """Back to the code's rate for ``name``; False if it had no override."""
        return bool(self._sync().hdel(self.key, name))

    def set_enforce(self, name: str, enforce: bool) -> None:
        """Enforce limit ``name`` (True) or run it in shadow mode (False), everywhere, over
        the code and the app's setting, until :meth:`unset_enforce`."""
        validate_name(name)
        self._sync().hset(self.modes_key, name, "1" if enforce else "0")

    def unset_enforce(self, name: str) -> bool:
        """Back to the code's and the app's choice for ``name``; False if none was set."""
        return bool(self._sync().hdel(self.modes_key, name))

    def read_enforce(self) -> dict[str, bool]:
        """Every limit switched at run time now: name -> enforced."""
        return _modes(self._sync().hgetall(self.modes_key))

    def enforcing(self) -> dict[str, bool]:
        """:meth:`read_enforce` as of at most :attr:`refresh` s ago (the last copy with the
        store down)."""
        self._current()
        return self._modes

    def read(self) -> dict[str, tuple[Rate, int]]:
        """Every override now: name -> (rate, burst); one unreadable is left out."""
        return _parsed(self._sync().hgetall(self.key))

    async def aapply(self, client: Any, limits: Sequence[AnyLimit]) -> list[AnyLimit]:
        """:meth:`apply` for asyncio code: the copy is read through ``client`` (a
        ``redis.asyncio`` client of the same server) when it is older than :attr:`refresh`."""
        now = self.clock()
        if now - self._read_at >= self.refresh:
            self._read_at = now
            # Store down: the decision itself reports it; the last copy stays.
            with contextlib.suppress(redis.RedisError):
                self._copy = _parsed(await client.hgetall(self.key))
        return _applied(limits, self._copy)

    def apply(self, limits: Sequence[AnyLimit]) -> list[AnyLimit]:
        """``limits`` with the overrides in force (a copy at most :attr:`refresh` s old).

        A cost above an overridden burst could never pass: it is capped at the
        burst.  With the store down the last copy read is used.
        """
        return _applied(limits, self._current())

    def _sync(self) -> redis.Redis | RedisCluster:
        if self.client is None:
            raise ValueError("these LiveLimits have no sync client: asyncio code uses aapply()")
        return self.client

    def _current(self) -> dict[str, tuple[Rate, int]]:
        now = self.clock()
        if now - self._read_at < self.refresh or self.client is None:
            return self._copy
        with self._lock:
            if now - self._read_at >= self.refresh:
                # Store down: the decision itself reports it; the last copy stays.
                with contextlib.suppress(redis.RedisError):
                    pipe = self._sync().pipeline(transaction=False)
                    pipe.hgetall(self.key)
                    pipe.hgetall(self.modes_key)
                    rates, modes = pipe.execute()
                    self._copy = _parsed(rates)
                    self._modes = _modes(modes)
                self._read_at = now
        return self._copy


def _modes(raw: dict[Any, Any]) -> dict[str, bool]:
    """The switches hash as read: name -> enforced."""
    return {text(k): text(v) == "1" for k, v in raw.items()}


def _parsed(raw: dict[Any, Any]) -> dict[str, tuple[Rate, int]]:
    """The overrides hash as read: name -> (rate, burst); one unreadable is left out."""
    found: dict[str, tuple[Rate, int]] = {}
    for name, value in raw.items():
        parts = text(value).split(" ", 2)
        try:
            found[text(name)] = (
                parse_rate(parts[2]), positive_int("burst", int(parts[1])))
        except (IndexError, ValueError):
            continue
    return found


def _applied(limits: Sequence[AnyLimit], overrides: dict[str, tuple[Rate, int]]
             ) -> list[AnyLimit]:
    """``limits`` with ``overrides`` (a cost above an overridden burst is capped at it)."""
    if not overrides:
        return list(limits)
    out: list[AnyLimit] = []
    for lim in limits:
        found = overrides.get(lim.name) if isinstance(lim, Limit) else None
        if found is None or not isinstance(lim, Limit):
            out.append(lim)
            continue
        rate, burst = found
        # (A set rate under the floor of a limit that learns: the set rate is the floor.)
        floor = lim.floor if lim.floor is None or lim.floor.interval_us >= rate.interval_us \
            else rate
        out.append(dataclasses.replace(lim, rate=rate, burst=burst,
                                       cost=min(lim.cost, burst), floor=floor))
    return out
