"""How the decision is made: :class:`Gate` runs ``lua/gate.lua`` on Redis.

The gate answers one question for every worker at once: *may this job start
now, and if not, exactly when?*  The decision is read, made and written in one
script call (never a check followed by an increment), on the Redis server's
clock by default so that workers with drifting clocks still agree.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import redis

from .keys import bucket_key, key_digest, validate_name, validate_prefix
from .rates import US_PER_SECOND, Rate, parse_rate

__all__ = ["Decision", "Gate", "Limit", "Reservation"]

_SCRIPT = importlib.resources.files(__package__).joinpath("lua/gate.lua").read_text("utf-8")

# Reply status codes of gate.lua (0 denied and 2 reserved are told apart by the booking).
_ALLOWED, _EARLY = 1, 3
_NEVER = -1
# The booked-limits mask travels as an integer (exact in a Lua double).
_MAX_LIMITS = 50


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"invalid {what} {value!r}: expected an integer >= 1")
    return value


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket to pass: ``name`` (and ``key``) at ``rate`` with ``burst``, charged ``cost``.

    ``burst`` starts may happen at the same instant; over any window of length
    ``w`` at most ``burst - 1 + ceil(w * rate)`` units pass.  ``cost`` units are
    charged per start; a cost above the burst could never pass and is refused.
    """

    name: str
    rate: Rate
    burst: int = 1
    key: object = field(default=None, repr=False)  # may be a secret: never shown
    cost: int = 1

    def __post_init__(self) -> None:
        validate_name(self.name)
        object.__setattr__(self, "rate", parse_rate(self.rate))
        _positive_int("burst", self.burst)
        _positive_int("cost", self.cost)
        if self.key is not None:
            key_digest(self.key)  # a TypeError naming the type, now rather than at the call
        if self.cost > self.burst:
            raise ValueError(
                f"cost {self.cost} exceeds burst {self.burst} of limit {self.name!r}: "
                "it could never pass; raise the burst or split the job"
            )


@dataclass(frozen=True, slots=True)
class Reservation:
    """A booked start: ``slot`` (server clock, microseconds) and the limits it is booked in.

    ``booked`` has bit ``i`` set for ``limits[i]`` of the call that booked it;
    the other limits are charged when the reservation is claimed.  ``epoch``
    identifies the store's lifetime: after a Redis restart or flush the
    buckets are empty and older reservations are void.
    """

    slot: int
    booked: int
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer.

    ``allowed``: start now.  Otherwise ``retry_after`` seconds is the exact
    wait, ``limit`` the limit that forced it and, when the call asked for a
    reservation and got one (or claimed one too early), ``reservation`` is the
    booked start to hand back as ``claim=`` when the job returns.  ``now`` is
    the decision's clock (microseconds), 0 on a plain "allowed" (kept off the
    hot path's reply).
    """

    allowed: bool
    retry_after: float
    limit: Limit | None = None
    reservation: Reservation | None = None
    now: int = 0
    early: bool = False

    @property
    def reserved(self) -> bool:
        """A slot is booked for this caller (it must wait ``retry_after``, then claim it)."""
        return not self.allowed and self.reservation is not None

    @property
    def slot(self) -> int | None:
        """The booked (or claimed) slot, server clock microseconds."""
        return self.reservation.slot if self.reservation is not None else None


_ADMITTED = Decision(True, 0.0)


@dataclass(frozen=True, slots=True)
class BucketState:
    """What a bucket holds right now, read without changing it (:meth:`Gate.inspect`).

    ``used``: units taken out of the burst (0 = full bucket; with bookings it
    goes past ``burst``).  ``next_free``: seconds until one start of the
    limit's cost would be admitted (0 = now).  ``booked_ahead``: starts booked
    beyond what the burst holds, i.e. deferred tasks waiting in this limit
    with a booked slot (tasks booked only in another of their limits, or
    waiting beyond the horizon, are not counted).  ``ttl``: seconds until the
    key expires (the bucket is full again then), 0 when absent.
    """

    limit: Limit
    exists: bool
    used: float
    next_free: float
    booked_ahead: int
    ttl: float
    now: int  # the clock the state was read at (microseconds)


class Gate:
    """Atomic multi-limit GCRA decisions on one Redis client.

    ``clock``: ``"server"`` (default) uses the Redis server's ``TIME``, so
    every caller agrees whatever its own clock says.  ``"local"`` passes this
    process's ``time.time()`` (looked up at each call, so freezegun applies),
    for servers that refuse ``TIME`` in scripts; any callable returning
    seconds may stand in for it.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "throttle",
        clock: Literal["server", "local"] | Callable[[], float] = "server",
    ) -> None:
        if clock not in ("server", "local") and not callable(clock):
            raise ValueError(f"invalid clock {clock!r}: expected 'server', 'local' or a callable")
        self.client = client
        self.prefix = validate_prefix(prefix)
        self.clock = clock
        # redis-py's Script does EVALSHA and reloads the body on NOSCRIPT
        # (after SCRIPT FLUSH or a restart), so no SHA cache of our own.
        self._script = client.register_script(_SCRIPT)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Gate:
        """A gate on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``)."""
        return cls(redis.Redis.from_url(url), **options)

    def __repr__(self) -> str:
        # The client's repr names host and db but never the password.
        clock = self.clock if isinstance(self.clock, str) else "caller"
        return f"Gate(prefix={self.prefix!r}, clock={clock!r})"

    def preload(self) -> None:
        """Load the script now, so the first decision is a plain EVALSHA."""
        self.client.script_load(_SCRIPT)

    def key_of(self, limit: Limit) -> str:
        """The Redis key of ``limit``'s bucket."""
        return bucket_key(self.prefix, limit.name, limit.key)

    def acquire(
        self,
        name: str,
        rate: str | Rate,
        *,
        burst: int = 1,
        key: object = None,
        cost: int = 1,
    ) -> Decision:
        """Try to start one job under a single limit; charged only if allowed."""
        return self.acquire_many([Limit(name, parse_rate(rate), burst, key, cost)])

    def acquire_many(
        self,
        limits: Sequence[Limit],
        *,
        reserve: float | None = None,
        claim: Reservation | None = None,
        grace: float = 0.0,
    ) -> Decision:
        """Pass every limit in ``limits`` at once, or none of them.

        ``reserve``: when denied and the wait is at most this many seconds, book
        the earliest common slot (``Decision.reserved``).  ``claim``: a
        reservation from an earlier call with the same ``limits``; honoured
        from its slot until ``grace`` seconds after it, if the limits it is not
        booked in admit then (``Decision.early`` while it is still ahead);
        otherwise void, and a fresh decision is made.
        """
        if not limits or len(limits) > _MAX_LIMITS:
            raise ValueError(f"acquire_many takes 1 to {_MAX_LIMITS} limits, got {len(limits)}")
        head = (
            self._now_us(),
            _NEVER if reserve is None else _to_us(reserve),
            claim.slot if claim is not None else 0,
            _to_us(grace),
            claim.booked if claim is not None else 0,
            claim.epoch if claim is not None else 0,
        )
        keys = [_key_bytes(self.prefix, lim.name, lim.key) for lim in limits]
        keys.append(_epoch_key(self.prefix))
        args = list(_head_args(*head))
        for lim in limits:
            args += _limit_args(lim.rate.interval_us, lim.burst, lim.cost)
        reply = self._script(keys=keys, args=args)
        if reply == _ALLOWED:  # the hot path replies with a bare integer
            return _ADMITTED
        status, wait_us, blocking, slot_us, now_us, mask, epoch = reply
        blocked = limits[blocking - 1] if blocking else None
        retry_after = wait_us / US_PER_SECOND
        booking = Reservation(slot_us, mask, epoch) if slot_us else None
        if status == _ALLOWED:
            return Decision(True, 0.0, None, booking, now_us)
        if status == _EARLY:
            return Decision(False, retry_after, None, booking, now_us, early=True)
        return Decision(False, retry_after, blocked, booking, now_us)

    def inspect(self, limit: Limit) -> BucketState:
        """Read ``limit``'s bucket without charging it (for status commands and metrics)."""
        key = self.key_of(limit)
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        pipe.time()
        raw, pttl, (sec, usec) = pipe.execute()
        now = self._now_us() or int(sec) * US_PER_SECOND + int(usec)
        interval = limit.rate.interval_us
        tat = max(int(raw), now) if raw is not None else now
        ahead = tat - now  # the bucket's content, in microseconds of emission
        used = ahead / interval
        # Same test as gate.lua: admitted when tat + c*T - B*T <= now.
        next_free = max(0, tat + (limit.cost - limit.burst) * interval - now)
        booked = max(0, math.ceil(used - 1e-9) - limit.burst)
        return BucketState(limit, raw is not None, used, next_free / US_PER_SECOND, booked,
                           max(0, int(pttl)) / 1000, now)

    def reset(self, limit: Limit) -> bool:
        """Forget ``limit``'s bucket (it is full again); True if it existed."""
        return bool(self.client.delete(self.key_of(limit)))

    def _now_us(self) -> int:
        if self.clock == "server":
            return 0  # the script reads TIME
        now = time.time() if self.clock == "local" else self.clock()
        return int(now * US_PER_SECOND)


# The arguments of a limit and a bucket's key are encoded once, not per call:
# with redis-py's pure-Python encoder that is a good part of a decision's cost.
@functools.lru_cache(maxsize=1024)
def _limit_args(interval_us: int, burst: int, cost: int) -> tuple[bytes, bytes, bytes]:
    return (str(interval_us).encode(), str(burst).encode(), str(cost).encode())


def _head_args(now: int, horizon: int, claim: int, grace: int, mask: int,
               epoch: int) -> tuple[bytes, ...]:
    if now == 0 and claim == 0:  # most calls: cache the few distinct ones
        return _plain_head(horizon, grace)
    return tuple(str(v).encode() for v in (now, horizon, claim, grace, mask, epoch))


@functools.lru_cache(maxsize=256)
def _plain_head(horizon: int, grace: int) -> tuple[bytes, ...]:
    return (b"0", str(horizon).encode(), b"0", str(grace).encode(), b"0", b"0")


@functools.lru_cache(maxsize=64)
def _epoch_key(prefix: str) -> bytes:
    return f"{{{prefix}}}:epoch".encode()


@functools.lru_cache(maxsize=65536)
def _cached_key(prefix: str, name: str, key: object) -> bytes:
    return bucket_key(prefix, name, key).encode()


def _key_bytes(prefix: str, name: str, key: object) -> bytes:
    try:
        return _cached_key(prefix, name, key)
    except TypeError:  # an unhashable key value (bytearray): hash it every time
        return bucket_key(prefix, name, key).encode()


def _to_us(seconds: float) -> int:
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"invalid duration {seconds!r}: expected seconds >= 0")
    return math.ceil(seconds * US_PER_SECOND)
