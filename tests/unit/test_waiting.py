"""Waiting for a start outside Celery (waiting.py): Gate.wait/admitted/limit and their async twins.

Real Redis and real time (rates of 20/s keep the tests short).  Booked starts
are the gate's own numbers, so spacing is checked on them exactly; the
callers' clocks only bound the totals.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import threading
import time
from typing import Any

import pytest
import redis

from celery_throttle import (
    AsyncGate,
    Concurrency,
    Decision,
    Gate,
    Limit,
    ThrottleTimeout,
    parse_rate,
)
from celery_throttle.core.waiting import NEAR, Ask, Sleep, drive, plan

RATE = Limit("api", parse_rate("20/s"))
INTERVAL_US = 50_000


class Counting(Gate):
    """A Gate that counts its decisions (a herd would show as many per waiter)."""

    calls = 0

    def acquire_many(self, *args: Any, **kwargs: Any) -> Decision:
        type(self).calls += 1
        return super().acquire_many(*args, **kwargs)


@pytest.fixture
def sgate(client: redis.Redis, prefix: str) -> Gate:
    Counting.calls = 0
    return Counting(client, prefix=prefix)


def _spaced(decisions: list[Decision]) -> None:
    """Every waiter got its own booked start, at least one interval after the one before."""
    starts = sorted(d.reservation.start for d in decisions if d.reservation is not None)
    assert len(starts) == len(set(starts)) == len(decisions) - 1  # the first started at once
    assert all(b - a >= INTERVAL_US for a, b in itertools.pairwise(starts))


def test_waiters_in_threads_get_distinct_spaced_starts_without_a_herd(sgate: Gate) -> None:
    """10 threads wait on 20/s: 10 distinct starts 50 ms apart, ~2 decisions each, ~0.45 s."""
    decisions: list[Decision] = []
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: decisions.append(sgate.wait([RATE], timeout=5)))
               for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    span = time.monotonic() - start
    assert len(decisions) == 10
    assert all(d.allowed for d in decisions)
    _spaced(decisions)
    assert Counting.calls <= 10 * 3  # book, claim (and at most one re-ask): no polling
    assert 0.4 <= span < 2.0


def _admitted_ahead(gate: Gate, grace: float) -> tuple[Any, Decision, Decision] | None:
    """A plan that booked a start 50 ms ahead, claimed it early and was admitted for it:
    (the plan, its booking, its admission), or None when this process's sleep overshot
    so far that the claim came after the booked start (the caller tries again)."""
    gate.acquire_many([RATE])  # the limit's next start is one interval away
    steps = plan([RATE], timeout=5, grace=grace)
    ask = next(steps)
    assert isinstance(ask, Ask)
    booked = gate.acquire_many([RATE], reserve=ask.reserve, claim=None, grace=grace)
    assert booked.reservation is not None
    sleep = steps.send(booked)
    assert isinstance(sleep, Sleep)
    # The plan wakes half a grace early (booked in every limit) ...
    assert sleep.seconds == pytest.approx(booked.retry_after - grace / 2)
    time.sleep(max(0.0, sleep.seconds - 0.01))  # ... and this sleep 10 ms more
    ask = steps.send(None)
    assert isinstance(ask, Ask)
    assert ask.claim == booked.reservation
    admitted = gate.acquire_many([RATE], reserve=ask.reserve, claim=ask.claim, grace=grace)
    assert admitted.allowed
    if admitted.retry_after <= 0:
        steps.close()
        return None
    return steps, booked, admitted


def test_a_waiter_woken_late_for_its_admitted_start_claims_it_again(sgate: Gate) -> None:
    """Admitted for its booked start just ahead (it claimed early), a waiter sleeps until it; woken
    past the grace it does not start then but claims again: the gate finds the booked start lost
    and decides afresh.  Woken in time, it starts."""
    grace = 0.04
    for late in (0.2, 0.0):
        for _ in range(5):  # bounded: a sleep overshooting 30 ms is rare
            found = _admitted_ahead(sgate, grace)
            if found is not None:
                break
            time.sleep(0.1)
        assert found is not None, "never admitted ahead of its booked start"
        steps, booked, admitted = found
        assert 0 < admitted.retry_after <= grace  # ... admitted for its booked start ahead
        sleep = steps.send(admitted)
        assert isinstance(sleep, Sleep)
        time.sleep(sleep.seconds + late)  # ... and wakes `late` after it
        if late:
            again = steps.send(None)
            assert isinstance(again, Ask)  # not started: it asks again
            assert again.claim == booked.reservation
            steps.close()
        else:
            with pytest.raises(StopIteration) as done:
                steps.send(None)
            assert done.value.value.decision is admitted
        time.sleep(0.1)  # (the next round starts on a free limit)


def test_a_near_start_costs_one_script_call_and_a_far_one_two(sgate: Gate) -> None:
    """Starts within NEAR are admitted in the call that books them (the waiter sleeps and
    starts); a booked start further away is booked, then claimed.  (A wide grace: a late wake-up
    would claim again, a third call, which is not what this counts.)"""
    assert NEAR >= 2 * INTERVAL_US / 1e6
    starts = []
    for _ in range(3):  # now, then 50 and 100 ms ahead of each call's answer
        d = sgate.wait([RATE], timeout=5, grace=0.5)
        assert d.allowed
        starts.append(time.monotonic())
    assert Counting.calls == 3
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(starts))
    slow = Limit("slow-far", parse_rate("2/s"))  # 500 ms apart: past NEAR
    assert sgate.acquire_many([slow]).allowed
    Counting.calls = 0
    d = sgate.wait([slow], timeout=5, grace=0.5)
    assert d.allowed
    assert Counting.calls == 2


def test_a_near_admission_woken_late_claims_its_start_again(sgate: Gate) -> None:
    """Admitted for a near start as it was booked, a waiter woken past the grace does not
    start then: it claims that start again, which the gate finds lost and decides afresh."""
    assert sgate.acquire_many([RATE]).allowed  # the next start is 50 ms away
    steps = plan([RATE], timeout=5, grace=0.02)
    ask = next(steps)
    assert isinstance(ask, Ask)
    assert ask.claim is None
    assert ask.near == NEAR
    admitted = sgate.acquire_many([RATE], reserve=ask.reserve, near=ask.near, grace=0.02)
    assert admitted.allowed
    assert 0 < admitted.retry_after <= 0.05
    assert admitted.reservation is not None
    assert admitted.reservation.booked == 1
    sleep = steps.send(admitted)
    assert isinstance(sleep, Sleep)
    assert sleep.booking == admitted.reservation
    time.sleep(sleep.seconds + 0.2)  # woken 200 ms late
    again = steps.send(None)
    assert isinstance(again, Ask)
    assert again.claim == admitted.reservation
    fresh = sgate.acquire_many([RATE], reserve=again.reserve, claim=again.claim, grace=0.02)
    assert fresh.allowed
    assert fresh.retry_after == 0
    with pytest.raises(StopIteration) as done:
        steps.send(fresh)
    assert done.value.value.decision is fresh


def test_async_waiters_get_distinct_spaced_starts(redis_url: str, prefix: str) -> None:
    """The same with 10 coroutines on AsyncGate."""
    async def main() -> list[Decision]:
        gate = AsyncGate.from_url(redis_url, prefix=prefix)
        try:
            return list(await asyncio.gather(*(gate.wait([RATE], timeout=5)
                                               for _ in range(10))))
        finally:
            await gate.aclose()

    decisions = asyncio.run(main())
    assert all(d.allowed for d in decisions)
    _spaced(decisions)


def test_a_wait_past_the_timeout_fails_at_once_and_books_nothing(sgate: Gate) -> None:
    """1/s, the next start taken: a 0.2 s timeout raises ThrottleTimeout naming the limit, at
    once."""
    slow = Limit("slow", parse_rate("1/s"))
    assert sgate.acquire_many([slow]).allowed
    before = sgate.inspect(slow).next_free
    started = time.monotonic()
    with pytest.raises(ThrottleTimeout, match=r"limit 'slow' would take 0\.9\d+s, past the "
                                               r"timeout of 0\.200s"):
        sgate.wait([slow], timeout=0.2)
    assert time.monotonic() - started < 0.5
    assert sgate.inspect(slow).next_free <= before  # nothing booked
    assert isinstance(ThrottleTimeout("x"), TimeoutError)


def test_an_interrupted_waiter_gives_its_booked_start_back(sgate: Gate) -> None:
    """KeyboardInterrupt while waiting for a start booked 1 s away: that start is free again."""
    slow = Limit("slow", parse_rate("1/s"))
    assert sgate.acquire_many([slow]).allowed
    free_at = sgate.inspect(slow).next_free

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    try:
        with pytest.raises(KeyboardInterrupt):
            sgate.wait([slow], timeout=5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # Without the give-back the next start would be one interval later (2 s).
    assert sgate.inspect(slow).next_free <= free_at


def test_a_caller_that_waits_elsewhere_gets_the_refusal_back(sgate: Gate) -> None:
    """A worker's options: a wait ``elsewhere`` says it does not sleep ends the plan with
    that refusal (its start booked, to claim on its next arrival); ``check`` sees every
    refusal first and may raise; after ``max_sleeps`` the next refusal ends it too."""
    slow = Limit("slow-elsewhere", parse_rate("1/s"))
    assert sgate.acquire_many([slow]).allowed
    seen: list[Decision] = []
    steps = plan([slow], horizon=5, near=0.0, elsewhere=lambda d: d.retry_after > 0.5,
                 check=seen.append, grace=lambda booked: 0.01 * (booked + 1))
    ask = next(steps)
    assert isinstance(ask, Ask)
    assert (ask.reserve, ask.grace, ask.in_line) == (5, 0.01, False)
    refused = sgate.acquire_many([slow], reserve=ask.reserve, grace=ask.grace)
    assert not refused.allowed
    assert refused.reservation is not None
    with pytest.raises(StopIteration) as done:
        steps.send(refused)
    assert done.value.value.decision is refused
    assert seen == [refused]

    # Nothing elsewhere, no sleep allowed: the first refusal ends it all the same.
    steps = plan([slow], horizon=5, near=0.0, elsewhere=lambda d: False, max_sleeps=0)
    ask = next(steps)
    assert isinstance(ask, Ask)
    again = sgate.acquire_many([slow], reserve=ask.reserve)
    with pytest.raises(StopIteration) as done:
        steps.send(again)
    assert done.value.value.decision is again

    # check raises: the plan ends with its error, nothing slept.
    def too_long(decision: Decision) -> None:
        raise ThrottleTimeout(f"{decision.retry_after:.3f}s is too long")

    steps = plan([slow], horizon=5, elsewhere=lambda d: False, check=too_long)
    next(steps)
    with pytest.raises(ThrottleTimeout, match="is too long"):
        steps.send(sgate.acquire_many([slow], reserve=5))


def test_a_new_booked_start_takes_its_grace_from_the_limits_it_is_booked_in(sgate: Gate) -> None:
    """``grace`` as a function of the booking: the claim of a start booked in every limit
    carries that start's grace, and the sleep wakes half of it early."""
    slow = Limit("slow-grace", parse_rate("2/s"))
    assert sgate.acquire_many([slow]).allowed
    steps = plan([slow], near=0.0, grace=lambda booked: 0.1 if booked else 0.02)
    ask = next(steps)
    assert isinstance(ask, Ask)
    assert ask.grace == 0.02  # nothing booked yet
    booked = sgate.acquire_many([slow], reserve=ask.reserve, grace=ask.grace)
    sleep = steps.send(booked)
    assert isinstance(sleep, Sleep)
    assert sleep.booking == booked.reservation
    assert sleep.seconds == pytest.approx(booked.retry_after - 0.05)
    claim = steps.send(None)
    assert isinstance(claim, Ask)
    assert (claim.claim, claim.grace) == (booked.reservation, 0.1)
    steps.close()
    assert booked.reservation is not None
    sgate.cancel([slow], booked.reservation)


def test_drive_gives_back_the_booking_its_sleep_held(sgate: Gate) -> None:
    """The worker's driver: a sleep interrupted (a time limit, a shutdown) hands the
    booking it held to ``give_back``, which frees the booked start."""
    slow = Limit("slow-drive", parse_rate("1/s"))
    assert sgate.acquire_many([slow]).allowed
    free_at = sgate.inspect(slow).next_free
    given: list[Any] = []

    def interrupted(step: Sleep) -> None:
        raise KeyboardInterrupt

    def give_back(booking: Any) -> None:
        given.append(booking)
        sgate.cancel([slow], booking)

    with pytest.raises(KeyboardInterrupt):
        drive(plan([slow], near=0.0, elsewhere=lambda d: False),
              lambda ask: sgate.acquire_many([slow], reserve=ask.reserve, claim=ask.claim,
                                             grace=ask.grace),
              interrupted, give_back)
    assert len(given) == 1
    assert given[0] is not None
    assert sgate.inspect(slow).next_free <= free_at


def test_a_cancelled_coroutine_gives_its_booked_start_back(redis_url: str, prefix: str) -> None:
    """asyncio cancellation of a waiter: its booking is returned; the next waiter gets it."""
    slow = Limit("slow", parse_rate("1/s"))

    async def main() -> tuple[float, float]:
        gate = AsyncGate.from_url(redis_url, prefix=prefix)
        try:
            assert (await gate.acquire_many([slow])).allowed
            waiter = asyncio.ensure_future(gate.wait([slow], timeout=5))
            await asyncio.sleep(0.1)
            booked = (await gate.inspect(slow)).next_free
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            return booked, (await gate.inspect(slow)).next_free
        finally:
            await gate.aclose()

    while_booked, after = asyncio.run(main())
    assert while_booked > 1.5  # the waiter's booked start (~0.9 s) was taken: next free after it
    assert after < 1.0  # given back


def test_admitted_holds_a_seat_past_its_lease_and_gives_it_back(sgate: Gate) -> None:
    """concurrency=1, lease 0.6 s, blocks of 1 s: renewed while held, so never two at once."""
    one = Concurrency("one", 1, lease=0.6)
    inside: list[tuple[float, float]] = []

    def block() -> None:
        with sgate.admitted([one], timeout=10):
            entered = time.monotonic()
            time.sleep(1.0)
            inside.append((entered, time.monotonic()))

    threads = [threading.Thread(target=block) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert len(inside) == 2
    (_a_in, a_out), (b_in, _) = sorted(inside)
    assert b_in >= a_out - 0.01  # the second entered after the first left, not at lease end
    assert sgate.inspect_leases(one).held == 0


def test_limit_decorates_functions_and_coroutines_of_the_right_gate(
        sgate: Gate, redis_url: str, prefix: str) -> None:
    """Gate.limit on a function, AsyncGate.limit on a coroutine; the wrong pairing is a clear
    TypeError at decoration."""
    calls: list[float] = []

    @sgate.limit("20/s", name="deco")
    def call(i: int) -> int:
        calls.append(time.monotonic())
        return i

    assert [call(i) for i in range(4)] == [0, 1, 2, 3]
    assert calls[-1] - calls[0] >= 3 * 0.05 - 0.02
    with pytest.raises(TypeError, match="coroutine function: decorate plain functions"):
        @sgate.limit("1/s", name="x")
        async def wrong() -> None: ...

    async def main() -> list[int]:
        agate = AsyncGate.from_url(redis_url, prefix=prefix)
        try:
            @agate.limit(concurrency=1, name="adeco")
            async def acall(i: int) -> int:
                await asyncio.sleep(0.05)
                return i

            with pytest.raises(TypeError, match="plain function"):
                @agate.limit("1/s", name="y")
                def wrong_too() -> None: ...
            return list(await asyncio.gather(*(acall(i) for i in range(3))))
        finally:
            await agate.aclose()

    assert asyncio.run(main()) == [0, 1, 2]
