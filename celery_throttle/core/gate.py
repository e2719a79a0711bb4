"""How the decision is made: :class:`Gate` runs the gate's commands (``lua/*.lua``) on Redis.

The gate answers one question for every worker at once: *may this job start
now, and if not, exactly when?*  The decision is read, made and written in one
script call (never a check followed by an increment), on the Redis server's
clock by default so that workers with drifting clocks still agree.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, cast

import redis
from redis.cluster import RedisCluster

from ..values import US_PER_SECOND, from_us, seconds, to_us, units
from . import waiting
from .connect import connect
from .keys import (
    bell_key,
    epoch_key,
    freed_key,
    validate_prefix,
)
from .limits import (
    ADMITTED,
    DEFAULT_LEASE,
    AnyLimit,
    BucketState,
    Concurrency,
    Decision,
    LeaseState,
    Limit,
    Reservation,
)
from .packed import AsyncPackedPath, Call, PackedPath, Plain
from .rates import Rate, parse_rate
from .scripts import script

# The records live in limits.py; they are re-exported here, where they were first.
__all__ = ["COMMANDS", "DEFAULT_LEASE", "AnyLimit", "BucketState", "Clock",
           "Concurrency", "Decision", "Gate", "GateCalls", "LeaseState", "Limit",
           "Reservation"]

#: The gate's commands, one script each (Gate and AsyncGate both run them): name -> the
#: script, with the libraries it includes (the rate bucket, the lease, the epoch: shared
#: with the waiting room's dispatch) in front.  "decide" is the hot path.
COMMANDS = {name: script(__package__, f"{name}.lua") for name in (
    "decide", "release", "renew", "pause", "resume", "settle", "follow", "cancel", "inspect")}

# Reply status codes of decide.lua (0 denied and 2 reserved are told apart by the booking).
_ALLOWED, _EARLY, _QUEUED = 1, 3, 4
_NEVER = -1
# The booked-limits mask travels as an integer (exact in a Lua double).
_MAX_LIMITS = 50


Clock = Literal["server", "local"] | Callable[[], float]
F = TypeVar("F", bound=Callable[..., Any])


class GateCalls:
    """What a gate sends and how it reads the answer, without the I/O.

    :class:`Gate` (redis-py) and :class:`~celery_throttle.AsyncGate`
    (``redis.asyncio``) are this plus the I/O of each method (a script call,
    or for a plain decision the packed path of ``packed.py``), so both send
    the same script the same arguments and read its replies one way.
    """

    def __init__(self, prefix: str, clock: Clock) -> None:
        if clock not in ("server", "local") and not callable(clock):
            raise ValueError(f"invalid clock {clock!r}: expected 'server', 'local' or a callable")
        self.prefix = validate_prefix(prefix)
        self.clock = clock
        # The packed hot path (packed.py), when the client can take it: the gate sets it.
        self._packed: PackedPath | AsyncPackedPath | None = None

    def __repr__(self) -> str:
        # No client in the repr: a client's names host and db, a URL may hold a password.
        clock = self.clock if isinstance(self.clock, str) else "caller"
        return f"{type(self).__name__}(prefix={self.prefix!r}, clock={clock!r})"

    def key_of(self, limit: AnyLimit) -> str:
        """The Redis key of ``limit``'s bucket (a concurrency limit's: its leases)."""
        return limit.key_in(self.prefix).decode()

    @staticmethod
    def _declared(rate: str | Rate | None, name: str, burst: int, cost: int, key: object,
                  concurrency: int | None, lease: float) -> list[AnyLimit]:
        """The limits ``limit()`` declares: a rate, a concurrency, or both, of one name."""
        if rate is None and concurrency is None:
            raise ValueError("give a rate, a concurrency, or both")
        limits: list[AnyLimit] = []
        if rate is not None:
            limits.append(Limit(name, parse_rate(rate), burst, key, cost))
        if concurrency is not None:
            limits.append(Concurrency(name, concurrency, key, lease))
        return limits

    def _plain(self, limits: Sequence[AnyLimit], reserve: float | None, grace: float,
               claim: Reservation | None, holder: str, in_line: bool = False,
               near: float = 0.0) -> Plain | None:
        """A plain decision's cache key and its packed command (or, the first time, its KEYS
        and ARGV, validated before any I/O); None: not a plain decision, the full path."""
        if self._packed is None or claim is not None or holder or self.clock != "server":
            return None
        key = (tuple(limits), reserve, grace, in_line, near)
        try:
            packed = self._packed.cached(key)  # the one hash of the key
        except TypeError:  # an unhashable key value (bytearray): the full path
            return None
        return key, packed if packed is not None else self._decide_call(
            limits, reserve, None, grace, "", in_line, near)

    def _decide_call(self, limits: Sequence[AnyLimit], reserve: float | None,
                     claim: Reservation | None, grace: float, holder: str,
                     in_line: bool = False, near: float = 0.0) -> Call:
        if not limits or len(limits) > _MAX_LIMITS:
            raise ValueError(f"acquire_many takes 1 to {_MAX_LIMITS} limits, got {len(limits)}")
        if not holder and any(lim.leased for lim in limits):
            raise ValueError("a Concurrency limit needs a holder (the lease owner's id)")
        keys = self._keys(limits)
        if in_line:
            keys += [lim.queue_in(self.prefix) for lim in limits]
        args = list(_decide_head(now=self._now_us(),
                                 horizon=_NEVER if reserve is None else to_us(reserve),
                                 claim=claim, grace=to_us(grace), holder=holder,
                                 near=to_us(near)))
        return keys, args + self._limit_args(limits)

    @staticmethod
    def _decision(limits: Sequence[AnyLimit], reply: Any) -> Decision:
        if reply == _ALLOWED:  # the hot path replies with a bare integer
            return ADMITTED
        status, wait_us, blocking, slot_us, now_us, mask, epoch, shift = reply
        blocked = limits[blocking - 1] if blocking else None
        retry_after = from_us(wait_us)
        booking = (Reservation(slot=slot_us, booked=mask, epoch=epoch, shift=shift)
                   if slot_us else None)
        if status == _ALLOWED:  # a claim honoured, at once or for its slot just ahead
            return Decision(True, retry_after, reservation=booking, now=now_us)
        if status == _EARLY:
            return Decision(False, retry_after, reservation=booking, now=now_us, early=True)
        if status == _QUEUED:
            return Decision(False, retry_after, limit=blocked, now=now_us, queued=True)
        return Decision(False, retry_after, limit=blocked, reservation=booking, now=now_us)

    def _call(self, limits: Sequence[AnyLimit], *head: object) -> Call:
        """KEYS and ARGV of a command that takes ``limits`` (``lua/limits.lua``) after its
        own ARGV ``head`` (its script names them; now, the first, is added here)."""
        args = [str(self._now_us()).encode(), *(str(v).encode() for v in head)]
        return self._keys(limits), args + self._limit_args(limits)

    def _release_call(self, limits: Sequence[AnyLimit], holder: str, ran_us: int) -> Call:
        keys, args = self._call(limits, holder, ran_us)
        # A seat given back: the tasks in line for one are due at once.
        keys += [lim.queue_in(self.prefix) for lim in limits if lim.leased]
        keys += [freed_key(self.prefix).encode(), bell_key(self.prefix).encode()]
        return keys, args

    def _paused_call(self, limits: Sequence[AnyLimit], *head: object) -> Call:
        if not limits:
            raise ValueError("pause and resume need at least one limit")
        return self._call(limits, *head)

    def _cancel_call(self, limits: Sequence[AnyLimit], booking: Reservation) -> Call:
        return self._call(limits, booking.slot, booking.booked, booking.epoch)

    def _settle_call(self, limit: Limit, actual: int, charged: int | None) -> Call | None:
        diff = (units("actual cost", actual)
                - (limit.cost if charged is None else units("charged cost", charged)))
        if diff == 0:
            return None
        args = [str(self._now_us()).encode(), str(limit.rate.interval_us).encode(),
                str(limit.burst).encode(), str(diff).encode()]
        return self._keys([limit]), args

    def _follow_call(self, limits: Sequence[AnyLimit], remaining: int,
                     reset: float) -> Call | None:
        """The "follow" call for the rate limits among ``limits`` that the report can
        bind, or None (decided here, without a round trip).

        A report binds a limit only if its own pace could spend more than
        ``remaining`` before ``reset``: (remaining + 1 - burst) intervals
        end before it.  Otherwise the script would leave the bucket alone
        (slots booked in it only make that more certain).
        """
        left = units("remaining", remaining)
        reset_us = to_us(seconds("reset", reset))
        bound = [lim for lim in limits if isinstance(lim, Limit)
                 and (left + 1 - lim.burst) * lim.rate.interval_us < reset_us]
        if not bound:
            return None
        args = [str(self._now_us()).encode(), str(reset_us).encode()]
        for lim in bound:
            args += [str(lim.rate.interval_us).encode(), str(lim.burst).encode(),
                     str(left).encode()]
        return self._keys(bound) + [lim.held_in(self.prefix) for lim in bound], args

    def _inspect_call(self, limit: AnyLimit) -> Call:
        keys, args = self._call([limit])
        return keys + self._held_keys(limit), args

    @staticmethod
    def _bucket_state(limit: Limit, reply: Any) -> BucketState:
        exists, ahead, next_free, pttl, now, paused, held, left, at = (int(v) for v in reply)
        used = ahead / limit.rate.interval_us  # the bucket's content, in starts
        booked = max(0, math.ceil(used - 1e-9) - limit.burst)
        return BucketState(limit=limit, exists=bool(exists), used=used,
                           next_free=from_us(next_free), booked_ahead=booked,
                           ttl=max(0, pttl) / 1000, now=now, paused=from_us(paused),
                           held=from_us(held) if left >= 0 else 0.0,
                           held_remaining=left if left >= 0 else None,
                           held_since=from_us(now - at) if left >= 0 else 0.0)

    @staticmethod
    def _lease_state(limit: Concurrency, reply: Any) -> LeaseState:
        held, paused, run, _now = (int(v) for v in reply)
        return LeaseState(limit=limit, held=held, paused=from_us(paused),
                          average_run=from_us(run))

    def _reset_keys(self, limit: AnyLimit) -> list[bytes]:
        return [limit.key_in(self.prefix), *limit.side_keys(self.prefix),
                *self._held_keys(limit)]

    def _held_keys(self, limit: AnyLimit) -> list[bytes]:
        """A rate limit's hold note (``Gate.follow``); a concurrency limit has none."""
        return [limit.held_in(self.prefix)] if isinstance(limit, Limit) else []

    def _keys(self, limits: Sequence[AnyLimit]) -> list[bytes]:
        """The limits' KEYS of every command (``lua/limits.lua``): each limit's key, the
        epoch, then each limit's side keys."""
        keys = [lim.key_in(self.prefix) for lim in limits]
        keys.append(_epoch_key(self.prefix))
        keys += [k for lim in limits for k in lim.side_keys(self.prefix)]
        return keys

    @staticmethod
    def _limit_args(limits: Sequence[AnyLimit]) -> list[bytes]:
        return [arg for lim in limits for arg in lim.script_args()]

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

    ``packed=False`` sends every decision through redis-py's ``Script``
    instead of the packed hot path (``packed.py``): the path it is measured
    against.  A store failure raises redis-py's ``RedisError`` family (an
    unreachable cluster: ``redis.ConnectionError``); :meth:`close`, or
    ``with``, closes the client.
    """

    def __init__(self, client: redis.Redis | RedisCluster, *, prefix: str = "throttle",
                 clock: Clock = "server", packed: bool = True) -> None:
        super().__init__(prefix, clock)
        self.client = client
        # Every call off the packed path goes through redis-py's Script:
        # EVALSHA, and the body again on NOSCRIPT (SCRIPT FLUSH, a restart).
        self._scripts = {name: client.register_script(text) for name, text in COMMANDS.items()}
        if packed and PackedPath.takes(client):
            self._packed = PackedPath(cast(redis.Redis, client), COMMANDS["decide"],
                                      self._scripts["decide"].sha)

    @classmethod
    def from_url(cls, url: str, *, master_name: str | None = None, **options: Any) -> Gate:
        """A gate on a new client for ``url``: ``redis://``, ``rediss://``, ``unix://``,
        ``sentinel://`` (with ``master_name``) or ``redis+cluster://`` (see ``connect``)."""
        return cls(connect(url, master_name=master_name), **options)

    def preload(self) -> None:
        """Load the commands' scripts now, so the first call of each is a plain EVALSHA."""
        for text in COMMANDS.values():
            self.client.script_load(text)

    def acquire(self, name: str, rate: str | Rate, *, burst: int = 1, key: object = None,
                cost: int = 1) -> Decision:
        """Try to start one job under a single limit; charged only if allowed."""
        return self.acquire_many([Limit(name, parse_rate(rate), burst, key, cost)])

    def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = None,
                     claim: Reservation | None = None, grace: float = 0.0,
                     holder: str = "", in_line: bool = False, near: float = 0.0) -> Decision:
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
        ``in_line`` (no claim): while a limit has tasks waiting in its queue
        (``room/queues.py``; a concurrency limit's queue for a seat, unless
        ``holder`` holds one already), do not start ahead of them; the
        decision is ``queued``, naming that limit, with the estimated wait.
        ``near`` (with ``reserve``): a slot booked at most this many seconds
        ahead in every limit is ``allowed`` at once for itself, with
        ``retry_after`` until it (sleep, then start: one call, no claim); a
        pause or settlement written meanwhile does not reach that start.
        """
        plain = self._plain(limits, reserve, grace, claim, holder, in_line, near)
        if plain is not None:
            reply = cast(PackedPath, self._packed).send(plain)
            if reply is not None:
                return self._decision(limits, reply)
        keys, args = self._decide_call(limits, reserve, claim, grace, holder, in_line, near)
        return self._decision(limits, self._run("decide", keys, args))

    def wait(self, limits: Sequence[AnyLimit], *, timeout: float | None = None,
             holder: str = "", grace: float = waiting.DEFAULT_GRACE) -> Decision:
        """Block until ``limits`` admit one start, and return that admission.

        The earliest slot is booked, so N waiters get N distinct, evenly
        spaced starts (no herd, no polling); the call sleeps until it and
        claims it.  Raises :class:`~celery_throttle.ThrottleTimeout` at once,
        booking nothing, when the start is further than ``timeout`` seconds
        away.  Interrupted (KeyboardInterrupt), it gives its booking back.
        ``holder``: the lease owner when a :class:`Concurrency` limit takes
        part (give the leases back with :meth:`release`, or use :meth:`slot`).
        """
        return waiting.wait(self, limits, timeout=timeout, holder=holder, grace=grace)

    def slot(self, limits: Sequence[AnyLimit], *, timeout: float | None = None,
             holder: str | None = None) -> contextlib.AbstractContextManager[Decision]:
        """``with gate.slot(limits):`` wait for a start (:meth:`wait`), run the block.

        Concurrency leases are renewed by a thread while the block runs and
        given back when it exits, however it exits.
        """
        return waiting.hold(self, limits, timeout=timeout, holder=holder)

    def limit(self, rate: str | Rate | None = None, *, name: str, burst: int = 1,
              cost: int = 1, key: object = None, concurrency: int | None = None,
              lease: float = DEFAULT_LEASE,
              timeout: float | None = None) -> Callable[[F], F]:
        """Decorate a plain function: every call waits for a start of limit ``name``.

        ``rate`` and/or ``concurrency`` as for ``@throttled``; the same
        ``name`` in the workers' ``@throttled`` shares the same bucket.
        Coroutine functions take :meth:`AsyncGate.limit` instead.
        """
        declared = self._declared(rate, name, burst, cost, key, concurrency, lease)
        return waiting.limited(self, declared, timeout)

    def release(self, limits: Sequence[AnyLimit], holder: str, ran_for: float = 0.0) -> int:
        """Give back ``holder``'s leases in the concurrency limits among ``limits``.

        ``ran_for`` (seconds) feeds the average run that paces waiters.  The
        tasks waiting in line for a freed seat are due at once (the waiting
        room's dispatcher serves them in their line's order).  Returns how many
        leases were released (0: none held, e.g. expired).
        """
        return int(self._run("release", *self._release_call(limits, holder, to_us(ran_for))))

    def extend(self, limits: Sequence[AnyLimit], holder: str) -> int:
        """Renew ``holder``'s leases for another lease time (a running task's heartbeat).

        A lease that expired is taken again if a seat is free.  Returns how
        many leases are lost (all seats taken by others meanwhile): 0 is good.
        """
        return int(self._run("renew", *self._call(limits, holder)))

    def pause(self, limits: Sequence[AnyLimit], seconds: float) -> float:
        """Admit nothing in any of ``limits`` for ``seconds`` (a provider's ``Retry-After``).

        Every worker sees it at its next decision; slots booked before the
        pause ends are void (their tasks book again after it).  A longer
        pause already set is kept.  Returns the seconds the pause lasts.
        """
        return from_us(int(self._run("pause", *self._paused_call(limits, to_us(seconds)))))

    def resume(self, limits: Sequence[AnyLimit]) -> int:
        """End a pause of ``limits`` now (:meth:`pause`); returns how many were paused."""
        return int(self._run("resume", *self._paused_call(limits)))

    def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int:
        """Give back ``booking`` (from :meth:`acquire_many` with the same ``limits``) unused.

        Only a bucket's last booking can be given back (its TAT moves back to
        the slot); one that later bookings or charges moved on keeps it, a
        hole that costs throughput but never lets two starts share a slot.
        Returns how many limits gave it back.
        """
        return int(self._run("cancel", *self._cancel_call(limits, booking)))

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
            self._run("settle", *call)

    def follow(self, limits: Sequence[AnyLimit], remaining: int, reset: float) -> int:
        """The provider says ``remaining`` units are left until its limit is full again,
        ``reset`` seconds from now (its rate-limit headers): spend at most that many before.

        Callers the gate cannot see (another service on the same API key)
        spend the provider's quota too; this is how the gate learns it.  A
        limit whose own pace would spend more before ``reset`` moves on (on
        every worker at once, as a settlement's charge: booked slots move
        with it); after ``reset`` the limit's own rate applies again.  A
        report that cannot bind any of ``limits`` costs no round trip.
        Returns how many limits moved.
        """
        call = self._follow_call(limits, remaining, reset)
        if call is None:
            return 0
        return int(self._run("follow", *call))

    def inspect(self, limit: Limit) -> BucketState:
        """Read ``limit``'s bucket without charging it (for status commands and metrics).

        The script's ``inspect`` operation answers, so "when is the next start
        free" is the decision's own admission test (bucket.lua), not a copy of it.
        """
        keys, args = self._inspect_call(limit)
        return self._bucket_state(limit, self._run("inspect", keys, args))

    def inspect_leases(self, limit: Concurrency) -> LeaseState:
        """Count ``limit``'s unexpired leases and read its pause, without changing them."""
        keys, args = self._inspect_call(limit)
        return self._lease_state(limit, self._run("inspect", keys, args))

    def reset(self, limit: AnyLimit) -> bool:
        """Forget ``limit``'s bucket (full again; a concurrency limit: its leases, pause)."""
        return bool(self.client.delete(*self._reset_keys(limit)))

    def close(self) -> None:
        """Close the client (its connection pool), and the connections the gate keeps."""
        if isinstance(self._packed, PackedPath):
            self._packed.close()
        self.client.close()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, command: str, keys: list[bytes], args: list[bytes]) -> Any:
        """Run the gate's ``command`` (its script: EVALSHA, the body again on NOSCRIPT)."""
        return self._scripts[command](keys=keys, args=args)


def _decide_head(*, now: int, horizon: int, claim: Reservation | None, grace: int,
                 holder: str, near: int) -> tuple[bytes, ...]:
    """ARGV[1..9] of decide.lua (its header names them), microseconds throughout."""
    if now == 0 and claim is None and not holder:
        return _plain_head(horizon, grace, near)  # most calls: the few distinct ones
    slot, mask, epoch, shift = ((claim.slot, claim.booked, claim.epoch, claim.shift)
                                if claim is not None else (0, 0, 0, 0))
    return (*(str(v).encode() for v in (now, horizon, slot, grace, mask, epoch)),
            holder.encode(), str(near).encode(), str(shift).encode())


@functools.lru_cache(maxsize=256)
def _plain_head(horizon: int, grace: int, near: int) -> tuple[bytes, ...]:
    return (b"0", str(horizon).encode(), b"0", str(grace).encode(), b"0", b"0", b"",
            str(near).encode(), b"0")


@functools.lru_cache(maxsize=64)
def _epoch_key(prefix: str) -> bytes:
    return epoch_key(prefix).encode()


