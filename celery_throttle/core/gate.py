"""How the decision is made: :class:`Gate` runs the gate's commands (``lua/*.lua``) on Redis.

The gate answers one question for every worker at once: *may this job start
now, and if not, exactly when?*  The decision is read, made and written in one
script call (never a check followed by an increment), on the Redis server's
clock by default so that workers with drifting clocks still agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
from redis.cluster import RedisCluster

from .. import values
from ..values import LONGEST_WAIT, to_us
from . import stops, waiting
from .calls import COMMANDS, Clock, F, GateCalls
from .connect import connect
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
from .packed import PackedPath
from .rates import Rate, parse_rate

# The records live in limits.py, the calls in calls.py; they are re-exported here,
# where they were first.
__all__ = ["COMMANDS", "DEFAULT_LEASE", "AnyLimit", "BucketState", "Clock",
           "Concurrency", "Decision", "Gate", "GateCalls", "LeaseState", "Limit",
           "Reservation"]


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
        the earliest common start (``Decision.reserved``).  ``claim``: a
        reservation from an earlier call with the same ``limits``; honoured
        from its booked start until ``grace`` seconds after it, if the limits it is not
        booked in admit then (``Decision.early`` while it is still ahead; up to
        ``grace`` ahead and booked in every limit, ``allowed`` with
        ``retry_after`` until the booked start); otherwise void, and a fresh decision
        is made.  A start later than its booked start moves the later booked starts back by as
        much, so starts keep the full interval.  ``holder``: the lease
        owner (required with a :class:`Concurrency` limit; the same holder
        asking again keeps its one lease).  A full concurrency limit books
        nothing: with ``reserve`` the decision is ``reserved`` with nothing
        booked (``Reservation.booked == 0``) at the holder's paced return time.
        ``in_line`` (no claim): while a limit has tasks waiting in its line
        (``room/lines.py``; a concurrency limit's line for a seat, unless
        ``holder`` holds one already), do not start ahead of them; the
        decision is ``queued``, naming that limit, with the estimated wait.
        ``near`` (with ``reserve``): a start booked at most this many seconds
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

        The earliest start is booked, so N waiters get N distinct, evenly
        spaced starts (no herd, no polling); the call sleeps until it and
        claims it.  Raises :class:`~celery_throttle.ThrottleTimeout` at once,
        booking nothing, when the start is further than ``timeout`` seconds
        away.  Interrupted (KeyboardInterrupt), it gives its booking back.
        ``holder``: the lease owner when a :class:`Concurrency` limit takes
        part (give the leases back with :meth:`release`, or use :meth:`admitted`).
        """
        return waiting.wait(self, limits, timeout=timeout, holder=holder, grace=grace)

    def admitted(self, limits: Sequence[AnyLimit], *, timeout: float | None = None,
             holder: str | None = None) -> contextlib.AbstractContextManager[Decision]:
        """``with gate.admitted(limits):`` wait for a start (:meth:`wait`), run the block.

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
        return waiting.limited(
            self, declared(name, rate, burst, key, cost, concurrency, lease), timeout)

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

    def pause(self, limits: Sequence[AnyLimit], seconds: float, *,
              refused_after: float | None = None) -> float:
        """Admit nothing in any of ``limits`` for ``seconds`` (a provider's ``Retry-After``).

        Every worker sees it at its next decision; starts booked before the
        pause ends are void (their tasks book again after it).  A longer
        pause already set is kept.  Returns the seconds the pause lasts.

        ``refused_after``: the provider refused, for its quota, a request admitted that many
        seconds ago: each limit that learns its rate (``Limit(adaptive=True)``) cuts it,
        unless the request was admitted before its last cut; ``seconds`` may then be 0 (a
        refusal that names no wait pauses nothing that learns).
        """
        return self._pause_reply(limits, self._run(
            "pause", *self._pause_call(limits, seconds, refused_after)))

    def stop(self, limits: Sequence[AnyLimit], reason: str, message: str) -> bool:
        """Stop ``limits`` until resumed (``core/stops.py``): pause them for
        :data:`~celery_throttle.values.LONGEST_WAIT` and record why (``reason``, the
        provider's ``message``) where every process reads it.  True when they were not
        stopped already (the caller says it once)."""
        already = self.stopped(limits)
        self.pause(limits, LONGEST_WAIT)
        records = {stop_field(lim.name, lim.key): stops.dumps(stops.record(lim, reason, message))
                   for lim in limits}
        self.client.hset(stops_key(self.prefix), mapping=records)  # type: ignore[arg-type]
        return already is None

    def stopped(self, limits: Sequence[AnyLimit]) -> stops.Stop | None:
        """Why ``limits`` are stopped (the first of them that is), None when none is."""
        if not limits:
            return None
        raws = self.client.hmget(stops_key(self.prefix),
                                     [stop_field(lim.name, lim.key) for lim in limits])
        return stops.first(raws)

    def stops(self, key: object = None) -> list[stops.Stop]:
        """Every limit stopped now (:meth:`stop`), declared anywhere or not: the shared
        ones, and the per-key ones for key value ``key``."""
        found = []
        for field, raw in self.client.hgetall(stops_key(self.prefix)).items():
            stop = stops.parse(raw)
            if stop is not None and values.text(field) == stop_field(
                    stop.limit, key if stop.per_key else None):
                found.append(stop)
        return found

    def resume(self, limits: Sequence[AnyLimit]) -> int:
        """End a pause of ``limits`` now (:meth:`pause`), a stop too (:meth:`stop`: its record
        goes); returns how many were paused."""
        ended = int(self._run("resume", *self._paused_call(limits)))
        if limits:
            self.client.hdel(stops_key(self.prefix),
                             *[stop_field(lim.name, lim.key) for lim in limits])
        return ended

    def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int:
        """Give back ``booking`` (from :meth:`acquire_many` with the same ``limits``) unused.

        Only a bucket's last booking can be given back (its TAT moves back to
        the booked start); one that later bookings or charges moved on keeps it, a
        hole that costs throughput but never lets two starts share one booked time.
        Returns how many limits gave it back.
        """
        return int(self._run("cancel", *self._cancel_call(limits, booking)))

    def settle(self, limit: Limit, actual: int, *, charged: int | None = None) -> None:
        """Correct ``limit``'s charge from its estimated ``cost`` to the ``actual`` units.

        The bucket is charged the difference (more than estimated), and
        every start booked in it before moves that much later too (booked at
        the estimates' pace, they would otherwise start too close together);
        or it is refunded the difference (less; never past a full bucket,
        and only while no start is booked beyond the burst: a lower TAT would
        hand a booked start's time out twice).  ``actual`` may exceed the
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
        every worker at once, as a settlement's charge: booked starts move
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

