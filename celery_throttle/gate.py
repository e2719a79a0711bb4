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

from .keys import (
    bucket_key,
    epoch_key,
    key_digest,
    leases_key,
    meta_key,
    room_key,
    validate_name,
    validate_prefix,
    waiters_key,
)
from .rates import US_PER_SECOND, Rate, parse_rate
from .values import check_cost, positive_int, to_us, units

__all__ = ["SCRIPT", "AnyLimit", "BucketState", "Clock", "Concurrency", "Decision", "Gate",
           "GateCalls", "LeaseState", "Limit", "Reservation"]

#: gate.lua, the one copy of the algorithm (Gate and AsyncGate both run it).
SCRIPT = importlib.resources.files(__package__).joinpath("lua/gate.lua").read_text("utf-8")

# Reply status codes of gate.lua (0 denied and 2 reserved are told apart by the booking).
_ALLOWED, _EARLY = 1, 3
_NEVER = -1
#: A lease a heartbeat does not extend ends this long after it was taken.
DEFAULT_LEASE = 30.0
# The booked-limits mask travels as an integer (exact in a Lua double).
_MAX_LIMITS = 50


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
        check_cost(self.cost, positive_int("burst", self.burst), self.name)
        if self.key is not None:
            key_digest(self.key)  # a TypeError naming the type, now rather than at the call


@dataclass(frozen=True, slots=True)
class Concurrency:
    """At most ``slots`` holders of ``name`` (and ``key``) at once, each on a lease.

    A holder (a task id) takes a slot when admitted and gives it back with
    :meth:`Gate.release`; :meth:`Gate.extend` renews the lease while it runs.
    A holder that never does either (its worker was killed) loses the slot
    ``lease`` seconds after it last renewed it.
    """

    name: str
    slots: int
    key: object = field(default=None, repr=False)  # may be a secret: never shown
    lease: float = DEFAULT_LEASE

    def __post_init__(self) -> None:
        validate_name(self.name)
        positive_int("concurrency", self.slots)
        if self.key is not None:
            key_digest(self.key)
        if (isinstance(self.lease, bool) or not isinstance(self.lease, int | float)
                or not 0.1 <= self.lease <= 86400):
            raise ValueError(f"invalid lease {self.lease!r}: expected seconds from 0.1 "
                             "to 86400")

    @property
    def lease_us(self) -> int:
        """The lease in microseconds."""
        return math.ceil(self.lease * US_PER_SECOND)


#: Either kind of limit; :meth:`Gate.acquire_many` decides them together.
AnyLimit = Limit | Concurrency


@dataclass(frozen=True, slots=True)
class Reservation:
    """A booked start: ``slot`` (server clock, microseconds) and the limits it is booked in.

    ``booked`` has bit ``i`` set for ``limits[i]`` of the call that booked it;
    the other limits are charged when the reservation is claimed.  ``epoch``
    identifies the store's lifetime: after a Redis restart or flush the
    buckets are empty and older reservations are void.  ``shift``: the booked
    limits' settlement shift when it was booked (microseconds): settlements
    that charged more than their estimates since then move the slot later.
    """

    slot: int
    booked: int
    epoch: int = 0
    shift: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The gate's answer.

    ``allowed``: start now, or, for a claim admitted for its slot just ahead of
    it, after ``retry_after`` seconds (at most the claim grace; the slot is
    the start's, so start then, not earlier).  Otherwise ``retry_after`` seconds is the exact
    wait, ``limit`` the limit that forced it and, when the call asked for a
    reservation and got one (or claimed one too early), ``reservation`` is the
    booked start to hand back as ``claim=`` when the job returns.  ``now`` is
    the decision's clock (microseconds), 0 on a plain "allowed" (kept off the
    hot path's reply).
    """

    allowed: bool
    retry_after: float
    limit: AnyLimit | None = None
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
    key expires (the bucket is full again then), 0 when absent.  ``paused``:
    seconds until a pause set by :meth:`Gate.pause` ends (``next_free``
    includes it).
    """

    limit: Limit
    exists: bool
    used: float
    next_free: float
    booked_ahead: int
    ttl: float
    now: int  # the clock the state was read at (microseconds)
    paused: float = 0.0  # seconds until a provider's pause ends (0: not paused)


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What a concurrency limit holds right now (:meth:`Gate.inspect_leases`)."""

    limit: Concurrency
    held: int  # unexpired leases
    paused: float  # seconds until a pause ends (0: not paused)
    average_run: float  # seconds, the moving average of released runs (0: none yet)


Clock = Literal["server", "local"] | Callable[[], float]
Call = tuple[list[bytes], list[bytes]]  # (KEYS, ARGV) of one gate.lua call


class GateCalls:
    """What a gate sends and how it reads the answer, without the I/O.

    :class:`Gate` (redis-py) and :class:`~celery_throttle.AsyncGate`
    (``redis.asyncio``) are this plus one line of I/O per method, so both
    send the same script the same arguments and read its replies one way.
    """

    def __init__(self, prefix: str, clock: Clock) -> None:
        if clock not in ("server", "local") and not callable(clock):
            raise ValueError(f"invalid clock {clock!r}: expected 'server', 'local' or a callable")
        self.prefix = validate_prefix(prefix)
        self.clock = clock

    def __repr__(self) -> str:
        # No client in the repr: a client's names host and db, a URL may hold a password.
        clock = self.clock if isinstance(self.clock, str) else "caller"
        return f"{type(self).__name__}(prefix={self.prefix!r}, clock={clock!r})"

    def key_of(self, limit: AnyLimit) -> str:
        """The Redis key of ``limit``'s bucket (a concurrency limit's: its leases)."""
        return _key_bytes(self.prefix, limit.name, limit.key,
                          isinstance(limit, Concurrency)).decode()

    def _decide_call(self, limits: Sequence[AnyLimit], reserve: float | None,
                     claim: Reservation | None, grace: float, holder: str) -> Call:
        if not limits or len(limits) > _MAX_LIMITS:
            raise ValueError(f"acquire_many takes 1 to {_MAX_LIMITS} limits, got {len(limits)}")
        if not holder and any(isinstance(lim, Concurrency) for lim in limits):
            raise ValueError("a Concurrency limit needs a holder (the lease owner's id)")
        args = list(_head_args(now=self._now_us(),
                               horizon=_NEVER if reserve is None else to_us(reserve),
                               claim=claim, grace=to_us(grace), holder=holder))
        return self._keys(limits), args + self._limit_args(limits)

    @staticmethod
    def _decision(limits: Sequence[AnyLimit], reply: Any) -> Decision:
        if reply == _ALLOWED:  # the hot path replies with a bare integer
            return _ADMITTED
        status, wait_us, blocking, slot_us, now_us, mask, epoch, shift = reply
        blocked = limits[blocking - 1] if blocking else None
        retry_after = wait_us / US_PER_SECOND
        booking = (Reservation(slot=slot_us, booked=mask, epoch=epoch, shift=shift)
                   if slot_us else None)
        if status == _ALLOWED:  # a claim honoured, at once or for its slot just ahead
            return Decision(True, retry_after, reservation=booking, now=now_us)
        if status == _EARLY:
            return Decision(False, retry_after, reservation=booking, now=now_us, early=True)
        return Decision(False, retry_after, limit=blocked, reservation=booking, now=now_us)

    def _op_call(self, limits: Sequence[AnyLimit], op: str, arg: int, holder: str) -> Call:
        if op == "pause" and not limits:
            raise ValueError("pause needs at least one limit")
        args = list(_head_args(now=self._now_us(), holder=holder, op=op.encode(), op_arg=arg))
        keys = self._keys(limits)
        if op == "release":
            keys += [waiters_key(self.prefix, lim.name, lim.key).encode() for lim in limits
                     if isinstance(lim, Concurrency)]
            keys += [room_key(self.prefix, part).encode() for part in ("parked", "messages",
                                                                       "wake")]
        return keys, args + self._limit_args(limits)

    def _settle_call(self, limit: Limit, actual: int, charged: int | None) -> Call | None:
        diff = (units("actual cost", actual)
                - (limit.cost if charged is None else units("charged cost", charged)))
        if diff == 0:
            return None
        args = [*_head_args(now=self._now_us(), op=b"settle"),
                str(limit.rate.interval_us).encode(), str(limit.burst).encode(),
                str(diff).encode()]
        return self._keys([limit]), args

    def _inspect_call(self, limit: AnyLimit) -> Call:
        args = [*_head_args(now=self._now_us(), op=b"inspect"), *self._limit_args([limit])]
        return self._keys([limit]), args

    @staticmethod
    def _bucket_state(limit: Limit, reply: Any) -> BucketState:
        exists, ahead, next_free, pttl, now, paused = (int(v) for v in reply)
        used = ahead / limit.rate.interval_us  # the bucket's content, in starts
        booked = max(0, math.ceil(used - 1e-9) - limit.burst)
        return BucketState(limit=limit, exists=bool(exists), used=used,
                           next_free=next_free / US_PER_SECOND, booked_ahead=booked,
                           ttl=max(0, pttl) / 1000, now=now, paused=paused / US_PER_SECOND)

    @staticmethod
    def _lease_state(limit: Concurrency, reply: Any) -> LeaseState:
        held, paused, run, _now = (int(v) for v in reply)
        return LeaseState(limit=limit, held=held, paused=paused / US_PER_SECOND,
                          average_run=run / US_PER_SECOND)

    def _reset_keys(self, limit: AnyLimit) -> list[str | bytes]:
        keys: list[str | bytes] = [self.key_of(limit)]
        if isinstance(limit, Concurrency):
            keys.append(_meta_key(self.prefix, limit.name, limit.key))
        return keys

    def _keys(self, limits: Sequence[AnyLimit]) -> list[bytes]:
        keys = [_key_bytes(self.prefix, lim.name, lim.key, isinstance(lim, Concurrency))
                for lim in limits]
        keys.append(_epoch_key(self.prefix))
        keys += [_meta_key(self.prefix, lim.name, lim.key) for lim in limits
                 if isinstance(lim, Concurrency)]
        return keys

    @staticmethod
    def _limit_args(limits: Sequence[AnyLimit]) -> list[bytes]:
        args: list[bytes] = []
        for lim in limits:
            if isinstance(lim, Concurrency):
                args += _limit_args(0, lim.slots, lim.lease_us)
            else:
                args += _limit_args(lim.rate.interval_us, lim.burst, lim.cost)
        return args

    def _now_us(self) -> int:
        if self.clock == "server":
            return 0  # the script reads TIME
        now = time.time() if self.clock == "local" else self.clock()
        return int(now * US_PER_SECOND)


class Gate(GateCalls):
    """Atomic multi-limit GCRA decisions on one Redis client.

    ``clock``: ``"server"`` (default) uses the Redis server's ``TIME``, so
    every caller agrees whatever its own clock says.  ``"local"`` passes this
    process's ``time.time()`` (looked up at each call, so freezegun applies),
    for servers that refuse ``TIME`` in scripts; any callable returning
    seconds may stand in for it.  :class:`~celery_throttle.AsyncGate` is the
    same on ``redis.asyncio``.
    """

    def __init__(self, client: redis.Redis, *, prefix: str = "throttle",
                 clock: Clock = "server") -> None:
        super().__init__(prefix, clock)
        self.client = client
        # redis-py's Script does EVALSHA and reloads the body on NOSCRIPT
        # (after SCRIPT FLUSH or a restart), so no SHA cache of our own.
        self._script = client.register_script(SCRIPT)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Gate:
        """A gate on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``)."""
        return cls(redis.Redis.from_url(url), **options)

    def preload(self) -> None:
        """Load the script now, so the first decision is a plain EVALSHA."""
        self.client.script_load(SCRIPT)

    def acquire(self, name: str, rate: str | Rate, *, burst: int = 1, key: object = None,
                cost: int = 1) -> Decision:
        """Try to start one job under a single limit; charged only if allowed."""
        return self.acquire_many([Limit(name, parse_rate(rate), burst, key, cost)])

    def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = None,
                     claim: Reservation | None = None, grace: float = 0.0,
                     holder: str = "") -> Decision:
        """Pass every limit in ``limits`` at once, or none of them.

        ``reserve``: when denied and the wait is at most this many seconds, book
        the earliest common slot (``Decision.reserved``).  ``claim``: a
        reservation from an earlier call with the same ``limits``; honoured
        from its slot until ``grace`` seconds after it, if the limits it is not
        booked in admit then (``Decision.early`` while it is still ahead; up to
        ``grace`` ahead and booked in every limit, ``allowed`` with
        ``retry_after`` until the slot); otherwise void, and a fresh decision
        is made.  A start later than its slot moves the later slots back by as
        much, so starts keep the full interval.  ``holder``: the lease
        owner (required with a :class:`Concurrency` limit; the same holder
        asking again keeps its one lease).  A full concurrency limit books
        nothing: with ``reserve`` the decision is ``reserved`` with nothing
        booked (``Reservation.booked == 0``) at the holder's paced return time.
        """
        keys, args = self._decide_call(limits, reserve, claim, grace, holder)
        return self._decision(limits, self._script(keys=keys, args=args))

    def release(self, limits: Sequence[AnyLimit], holder: str, ran_for: float = 0.0) -> int:
        """Give back ``holder``'s leases in the concurrency limits among ``limits``.

        ``ran_for`` (seconds) feeds the average run that paces waiters.  A
        freed slot goes at once to the oldest task parked for it in the
        waiting room (its lease is taken in its name).  Returns how many
        leases were released (0: none held, e.g. expired).
        """
        return self._op(limits, "release", to_us(ran_for), holder)

    def extend(self, limits: Sequence[AnyLimit], holder: str) -> int:
        """Renew ``holder``'s leases for another lease time (a running task's heartbeat).

        A lease that expired is taken again if a slot is free.  Returns how
        many leases are lost (all slots taken by others meanwhile): 0 is good.
        """
        return self._op(limits, "extend", 0, holder)

    def pause(self, limits: Sequence[AnyLimit], seconds: float) -> float:
        """Admit nothing in any of ``limits`` for ``seconds`` (a provider's ``Retry-After``).

        Every worker sees it at its next decision; slots booked before the
        pause ends are void (their tasks book again after it).  A longer
        pause already set is kept.  Returns the seconds the pause lasts.
        """
        return self._op(limits, "pause", to_us(seconds), "") / US_PER_SECOND

    def settle(self, limit: Limit, actual: int, *, charged: int | None = None) -> None:
        """Correct ``limit``'s charge from its estimated ``cost`` to the ``actual`` units.

        The bucket is charged the difference (more than estimated), and
        every slot booked in it before moves that much later too (booked at
        the estimates' pace, they would otherwise start too close together);
        or it is refunded the difference (less; never past a full bucket,
        and only while no slot is booked beyond the burst: a lower TAT would
        hand a booked slot's time out twice).  ``actual`` may exceed the
        burst: the bucket then owes.  ``charged``: what was charged if not
        ``limit.cost`` (an earlier settlement).
        """
        call = self._settle_call(limit, actual, charged)
        if call is not None:
            self._script(keys=call[0], args=call[1])

    def inspect(self, limit: Limit) -> BucketState:
        """Read ``limit``'s bucket without charging it (for status commands and metrics).

        The script's ``inspect`` operation answers, so "when is the next start
        free" is gate.lua's own admission test, not a copy of it.
        """
        keys, args = self._inspect_call(limit)
        return self._bucket_state(limit, self._script(keys=keys, args=args))

    def inspect_leases(self, limit: Concurrency) -> LeaseState:
        """Count ``limit``'s unexpired leases and read its pause, without changing them."""
        keys, args = self._inspect_call(limit)
        return self._lease_state(limit, self._script(keys=keys, args=args))

    def reset(self, limit: AnyLimit) -> bool:
        """Forget ``limit``'s bucket (full again; a concurrency limit: its leases, pause)."""
        return bool(self.client.delete(*self._reset_keys(limit)))

    def _op(self, limits: Sequence[AnyLimit], op: str, arg: int, holder: str) -> int:
        keys, args = self._op_call(limits, op, arg, holder)
        return int(self._script(keys=keys, args=args))


# The arguments of a limit and a bucket's key are encoded once, not per call:
# with redis-py's pure-Python encoder that is a good part of a decision's cost.
@functools.lru_cache(maxsize=1024)
def _limit_args(interval_us: int, burst: int, cost: int) -> tuple[bytes, bytes, bytes]:
    return (str(interval_us).encode(), str(burst).encode(), str(cost).encode())


def _head_args(*, now: int = 0, horizon: int = _NEVER, claim: Reservation | None = None,
               grace: int = 0, holder: str = "", op: bytes = b"a",
               op_arg: int = 0) -> tuple[bytes, ...]:
    """ARGV[1..10] of gate.lua (its header names them), microseconds throughout."""
    if now == 0 and claim is None and not holder and op == b"a":
        return _plain_head(horizon, grace)  # most calls: cache the few distinct ones
    slot, mask, epoch, shift = ((claim.slot, claim.booked, claim.epoch, claim.shift)
                                if claim is not None else (0, 0, 0, 0))
    return (*(str(v).encode() for v in (now, horizon, slot, grace, mask, epoch)),
            holder.encode(), op, str(op_arg).encode(), str(shift).encode())


@functools.lru_cache(maxsize=256)
def _plain_head(horizon: int, grace: int) -> tuple[bytes, ...]:
    return (b"0", str(horizon).encode(), b"0", str(grace).encode(), b"0", b"0", b"", b"a",
            b"0", b"0")


def _parse_bucket(raw: bytes | None) -> tuple[int, int]:
    """A rate bucket's TAT and pause: ``TAT``, ``TAT:until``, ``TAT:until:shift`` (gate.lua)."""
    if raw is None:
        return 0, 0
    tat, _, rest = raw.partition(b":")
    paused, _, _shift = rest.partition(b":")
    return int(tat), int(paused or 0)


@functools.lru_cache(maxsize=64)
def _epoch_key(prefix: str) -> bytes:
    return epoch_key(prefix).encode()


@functools.lru_cache(maxsize=65536)
def _cached_key(prefix: str, name: str, key: object, leases: bool = False) -> bytes:
    return (leases_key if leases else bucket_key)(prefix, name, key).encode()


def _key_bytes(prefix: str, name: str, key: object, leases: bool = False) -> bytes:
    try:
        return _cached_key(prefix, name, key, leases)
    except TypeError:  # an unhashable key value (bytearray): hash it every time
        return (leases_key if leases else bucket_key)(prefix, name, key).encode()


def _meta_key(prefix: str, name: str, key: object) -> bytes:
    return meta_key(prefix, name, key).encode()
