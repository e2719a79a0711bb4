"""Concurrency leases, provider pauses and settled costs at the gate, on real Redis.

Every decision runs the real ``decide.lua``; the caller clock is moved
explicitly, so lease expiry and pauses are exact without sleeping.
"""

from __future__ import annotations

import pytest
import redis

from celery_throttle import (
    Concurrency,
    Decision,
    Gate,
    Limit,
    Reservation,
    parse_rate,
    settle,
)

from ..clock import T0, StepClock


def test_at_most_n_holders_and_a_release_frees_a_seat(cgate: Gate) -> None:
    """Two seats: a and b hold, c is refused; after a releases, c gets the booked start."""
    two = Concurrency("llm-inflight", 2)
    assert cgate.acquire_many([two], holder="a").allowed
    assert cgate.acquire_many([two], holder="b").allowed
    refused = cgate.acquire_many([two], holder="c")
    assert not refused.allowed
    assert refused.limit == two
    assert cgate.inspect_leases(two).held == 2
    assert cgate.release([two], "a", ran_for=0.4) == 1
    assert cgate.release([two], "a") == 0  # released once only
    assert cgate.acquire_many([two], holder="c").allowed
    assert cgate.inspect_leases(two).held == 2


def test_the_same_holder_asking_again_keeps_one_lease(cgate: Gate) -> None:
    """A redelivered task (same id) re-enters its own lease instead of taking a second."""
    one = Concurrency("solo", 1)
    assert cgate.acquire_many([one], holder="t1").allowed
    assert cgate.acquire_many([one], holder="t1").allowed
    assert cgate.inspect_leases(one).held == 1


def test_an_expired_lease_is_reclaimed_by_the_next_acquire(cgate: Gate, clock: StepClock
                                                           ) -> None:
    """A holder that stops renewing (killed worker) loses its booked start one lease time later."""
    one = Concurrency("solo", 1, lease=5)
    assert cgate.acquire_many([one], holder="dead").allowed
    clock.us = T0 + 4_999_999
    assert not cgate.acquire_many([one], holder="next").allowed
    clock.us = T0 + 5_000_000
    assert cgate.acquire_many([one], holder="next").allowed
    assert cgate.extend([one], "dead") == 1  # the dead holder's lease is gone for good


def test_a_heartbeat_keeps_the_seat_past_the_lease(cgate: Gate, clock: StepClock) -> None:
    """Renewed every 2 s, a 5 s lease is held for 20 s; an expired one is retaken if free."""
    one = Concurrency("solo", 1, lease=5)
    assert cgate.acquire_many([one], holder="long").allowed
    for _ in range(10):
        clock.us += 2_000_000
        assert cgate.extend([one], "long") == 0
        assert not cgate.acquire_many([one], holder="other").allowed
    clock.us += 6_000_000  # missed its renewals: expired, but nobody took the booked start
    assert cgate.extend([one], "long") == 0
    assert cgate.inspect_leases(one).held == 1


def test_concurrency_and_rate_are_all_or_nothing(cgate: Gate, clock: StepClock) -> None:
    """A full concurrency limit charges no rate; a busy rate takes no lease."""
    rate = Limit("rps", parse_rate("1/s"))
    one = Concurrency("inflight", 1)
    assert cgate.acquire_many([rate, one], holder="a").allowed
    clock.us += 1_000_000  # the rate admits again, the booked start is still held by a
    assert not cgate.acquire_many([rate, one], holder="b").allowed
    assert cgate.inspect(rate).next_free == 0.0  # b charged nothing
    assert cgate.release([rate, one], "a") == 1
    assert cgate.acquire_many([rate], holder="x").allowed  # rate now busy for 1 s
    assert not cgate.acquire_many([rate, one], holder="b").allowed
    assert cgate.inspect_leases(one).held == 0  # b took no lease


def test_full_limit_paces_waiters_by_the_average_run(cgate: Gate, clock: StepClock) -> None:
    """Waiters are told to come back one (average run / seats) apart, not all at once."""
    two = Concurrency("pool", 2)
    assert cgate.acquire_many([two], holder="a").allowed
    assert cgate.release([two], "a", ran_for=0.8) == 1  # average run 0.8 s
    assert cgate.acquire_many([two], holder="a").allowed
    assert cgate.acquire_many([two], holder="b").allowed
    returns = []
    for waiter in ("w1", "w2", "w3"):
        d = cgate.acquire_many([two], holder=waiter, reserve=60)
        assert d.reserved
        assert d.reservation is not None
        assert d.reservation.booked == 0  # nothing can be booked in a lease
        returns.append(d.start)
    assert returns == [T0 + 400_000, T0 + 800_000, T0 + 1_200_000]
    assert cgate.inspect_leases(two).average_run == 0.8


def test_waiters_are_paced_by_the_oldest_run_before_any_ended(cgate: Gate, clock: StepClock
                                                               ) -> None:
    """No run has ended yet: the step follows the holders' age, from 50 ms to 1 s / seats."""
    two = Concurrency("pool", 2)
    assert cgate.acquire_many([two], holder="a").allowed
    assert cgate.acquire_many([two], holder="b").allowed
    first = cgate.acquire_many([two], holder="w1", reserve=60)
    assert first.start == T0 + 25_000  # nothing known: 50 ms / 2 seats
    clock.us = T0 + 600_000  # a and b have run 0.6 s: runs are at least that long
    later = cgate.acquire_many([two], holder="w2", reserve=60)
    assert later.start == T0 + 600_000 + 300_000
    clock.us = T0 + 5_000_000  # 5 s: the guess stops at 1 s (a freed seat stays idle less)
    again = cgate.acquire_many([two], holder="w3", reserve=60)
    assert again.start == T0 + 5_000_000 + 500_000
    assert cgate.release([two], "a") == 1  # measured on the server's side: 5 s
    assert cgate.inspect_leases(two).average_run == 5.0


def test_pause_stops_every_caller_until_it_ends(cgate: Gate, clock: StepClock) -> None:
    """A 3 s pause (Retry-After: 3) denies all, is visible in inspect, and ends exactly."""
    rate = Limit("provider", parse_rate("100/s"), burst=10)
    assert cgate.pause([rate], 3) == 3.0
    state = cgate.inspect(rate)
    assert state.paused == 3.0
    assert state.next_free == 3.0
    d = cgate.acquire_many([rate])
    assert not d.allowed
    assert d.retry_after == 3.0
    assert d.limit == rate
    assert cgate.pause([rate], 1) == 3.0  # a shorter pause does not cut the longer one
    clock.us = T0 + 2_999_999
    assert not cgate.acquire_many([rate]).allowed
    clock.us = T0 + 3_000_000
    assert all(cgate.acquire_many([rate]).allowed for _ in range(10))  # the burst, then
    assert not cgate.acquire_many([rate]).allowed
    assert cgate.inspect(rate).paused == 0.0


def test_pause_voids_starts_booked_before_it(cgate: Gate, clock: StepClock) -> None:
    """A task booked for 0.5 s from now may not start in a 2 s pause: it books after it."""
    rate = Limit("provider", parse_rate("2/s"))
    assert cgate.acquire_many([rate]).allowed
    booked = cgate.acquire_many([rate], reserve=10)
    assert booked.start == T0 + 500_000
    cgate.pause([rate], 2)
    clock.us = T0 + 500_000
    again = cgate.acquire_many([rate], claim=booked.reservation, grace=0.1, reserve=10)
    assert again.reserved
    assert again.start == T0 + 2_000_000


def test_pause_of_a_concurrency_limit(cgate: Gate, clock: StepClock) -> None:
    """A paused concurrency limit with free seats admits nobody until the pause ends."""
    four = Concurrency("inflight", 4)
    assert cgate.pause([four], 1.5) == 1.5
    d = cgate.acquire_many([four], holder="a", reserve=60)
    assert d.reserved
    assert d.retry_after == 1.5
    assert cgate.inspect_leases(four).paused == 1.5
    clock.us = T0 + 1_500_000
    assert cgate.acquire_many([four], holder="a").allowed


def test_settle_charges_or_refunds_the_difference(cgate: Gate) -> None:
    """Estimated 100 tokens: actual 200 charges 100 more, actual 40 gives 60 back."""
    tokens = Limit("tokens", parse_rate("1000/s"), burst=1000, cost=100)
    assert cgate.acquire_many([tokens]).allowed
    assert cgate.inspect(tokens).used == pytest.approx(100)
    cgate.settle(tokens, 200)
    assert cgate.inspect(tokens).used == pytest.approx(200)
    cgate.settle(tokens, 40)
    assert cgate.inspect(tokens).used == pytest.approx(140)
    cgate.settle(tokens, 0)
    cgate.settle(tokens, 0)
    assert cgate.inspect(tokens).used == 0  # never fuller than full
    cgate.settle(tokens, 3000)  # more than the burst: the bucket owes 2,900 units
    # The next 100-unit start waits until 100 of the 1,000 fit again: 2.9 - 0.9 s.
    assert cgate.inspect(tokens).next_free == pytest.approx(2.0)


def test_settle_keeps_a_pause(cgate: Gate) -> None:
    """Settling during a pause does not lift it."""
    tokens = Limit("tokens", parse_rate("1000/s"), burst=1000, cost=100)
    assert cgate.acquire_many([tokens]).allowed
    cgate.pause([tokens], 2)
    cgate.settle(tokens, 50)
    assert cgate.inspect(tokens).paused == 2.0


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_settle_rejects_bad_actual_costs(cgate: Gate, bad: object) -> None:
    """The error names the value."""
    tokens = Limit("tokens", parse_rate("1000/s"), burst=1000, cost=100)
    with pytest.raises(ValueError, match=f"invalid actual cost {bad!r}"):
        cgate.settle(tokens, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seats", "lease", "match"), [
    (0, 30, "invalid concurrency 0"), (True, 30, "invalid concurrency True"),
    (2, 0, "invalid lease 0"), (2, "30", "invalid lease '30'")])
def test_bad_concurrency_limits_name_the_value(seats: object, lease: object, match: str) -> None:
    """Seats must be an int >= 1, the lease seconds in range."""
    with pytest.raises(ValueError, match=match):
        Concurrency("x", seats, lease=lease)  # type: ignore[arg-type]


def test_concurrency_needs_a_holder(cgate: Gate) -> None:
    """Without a holder id the lease could not be released: refused up front."""
    with pytest.raises(ValueError, match="needs a holder"):
        cgate.acquire_many([Concurrency("x", 1)])


def test_rate_and_concurrency_of_one_name_are_separate_keys(cgate: Gate) -> None:
    """`@throttled("5/s", concurrency=2, name="llm")` keeps both under one name."""
    rate = Limit("llm", parse_rate("5/s"))
    two = Concurrency("llm", 2)
    assert cgate.key_of(rate) != cgate.key_of(two)
    assert cgate.acquire_many([rate, two], holder="a").allowed
    assert cgate.inspect_leases(two).held == 1




def test_settle_outside_a_worker_run_does_nothing() -> None:
    """Direct calls and eager mode were never admitted: nothing to correct."""
    assert settle(10) is False
    with pytest.raises(ValueError, match="invalid actual cost -1"):
        settle(-1)


def test_settled_charge_moves_the_starts_booked_before_it(cgate: Gate, clock: StepClock
                                                         ) -> None:
    """Booked at the estimates' pace, a booked start moves by what a settlement charged on top.

    10 units/s, burst 1, cost 1: the second and third starts are booked 0.1
    and 0.2 s out.  The first call used 4 units (3 more than estimated):
    each booked start is honoured 0.3 s later, and a new booking comes after
    them, so the starts keep the true cost's pace.
    """
    rate = Limit("tokens", parse_rate("10/s"))
    assert cgate.acquire_many([rate]).allowed
    second = cgate.acquire_many([rate], reserve=10).reservation
    third = cgate.acquire_many([rate], reserve=10).reservation
    assert second is not None
    assert third is not None
    assert (second.start, third.start) == (T0 + 100_000, T0 + 200_000)
    cgate.settle(rate, 4)
    clock.us = second.start
    early = cgate.acquire_many([rate], claim=second, grace=0.02, reserve=10)
    assert early.early
    assert early.retry_after == pytest.approx(0.3)
    clock.us = second.start + 300_000
    assert cgate.acquire_many([rate], claim=second, grace=0.02, reserve=10).allowed
    clock.us = third.start + 300_000
    assert cgate.acquire_many([rate], claim=third, grace=0.02, reserve=10).allowed
    fourth = cgate.acquire_many([rate], reserve=10)
    assert fourth.start == T0 + 600_000  # after the shifted third (0.5 s), one interval on


def test_no_refund_while_starts_are_booked_past_the_burst(cgate: Gate, clock: StepClock
                                                         ) -> None:
    """A refund with starts booked ahead would hand their times out twice: it waits."""
    rate = Limit("tokens", parse_rate("10/s"), cost=1)
    assert cgate.acquire_many([rate]).allowed
    booked = cgate.acquire_many([rate], reserve=10)
    assert booked.start == T0 + 100_000
    cgate.settle(rate, 0)  # the first call used nothing: no refund, a start is booked ahead
    assert cgate.acquire_many([rate], reserve=10).start == T0 + 200_000
    clock.us = T0 + 1_000_000  # nothing booked ahead any more: refunds apply again
    assert cgate.acquire_many([rate]).allowed
    cgate.settle(rate, 0)
    assert cgate.acquire_many([rate]).allowed  # the refunded unit


def _starts_before(cgate: Gate, clock: StepClock, limits: list[Limit], until_us: int,
                   step_us: int = 10_000) -> list[int]:
    """Every start the gate admits while the clock steps from now to ``until_us`` (exclusive)."""
    starts = []
    while clock.us < until_us:
        if cgate.acquire_many(limits).allowed:
            starts.append(clock.us - T0)
        clock.us += step_us
    return starts


def test_a_provider_report_caps_the_starts_until_its_reset(cgate: Gate, clock: StepClock
                                                            ) -> None:
    """10/s, burst 1; the provider says 2 requests are left until it is full in 1 s: 2 starts
    before the reset (the last two intervals before it), the next one at the reset, then the
    limit's own pace again."""
    rate = Limit("api", parse_rate("10/s"))
    assert cgate.follow([rate], remaining=2, reset=1.0) == 1
    assert _starts_before(cgate, clock, [rate], T0 + 1_000_000) == [800_000, 900_000]
    assert cgate.acquire_many([rate]).allowed  # at the reset
    assert _starts_before(cgate, clock, [rate], T0 + 1_500_000) == [
        1_100_000, 1_200_000, 1_300_000, 1_400_000]


def test_a_report_of_plenty_changes_nothing_and_costs_no_call(
        cgate: Gate, client: redis.Redis, clock: StepClock) -> None:
    """With more left than the limit would spend before the reset, the bucket is left alone,
    decided without asking the store (no key written); nothing left pauses until the reset."""
    rate = Limit("plenty", parse_rate("10/s"), burst=5)
    assert cgate.follow([rate], remaining=20, reset=1.0) == 0
    assert client.exists(cgate.key_of(rate)) == 0
    assert [cgate.acquire_many([rate]).allowed for _ in range(6)] == [True] * 5 + [False]
    assert _starts_before(cgate, clock, [rate], T0 + 500_000) == [
        100_000, 200_000, 300_000, 400_000]  # after the burst, the limit's pace
    assert cgate.follow([rate], remaining=0, reset=2.0) == 1
    # Nothing left until 2.5 s; a burst of 5 then holds 1 start at the reset, the next
    # ones at the limit's pace.
    assert _starts_before(cgate, clock, [rate], T0 + 2_500_000) == []
    assert _starts_before(cgate, clock, [rate], T0 + 2_800_000) == [
        2_500_000, 2_600_000, 2_700_000]


def test_a_report_moves_the_starts_booked_before_it(cgate: Gate, clock: StepClock) -> None:
    """A booked start is a start the provider has not seen: 1 left until 1 s, and one start
    booked 0.1 s out, so the booked start moves to the last interval before the reset and
    nothing else starts before it."""
    rate = Limit("booked", parse_rate("10/s"))
    assert cgate.acquire_many([rate]).allowed
    booked = cgate.acquire_many([rate], reserve=10).reservation
    assert booked is not None
    assert booked.start == T0 + 100_000
    assert cgate.follow([rate], remaining=1, reset=1.0) == 1
    clock.us = booked.start
    early = cgate.acquire_many([rate], claim=booked, grace=0.02, reserve=10)
    assert early.early
    assert early.retry_after == pytest.approx(0.8)  # at 0.9 s, the last start before 1 s
    clock.us = T0 + 900_000
    assert cgate.acquire_many([rate], claim=booked, grace=0.02, reserve=10).allowed
    assert not cgate.acquire_many([rate]).allowed


def test_a_limit_held_by_a_report_says_so_until_the_reset(cgate: Gate, clock: StepClock
                                                          ) -> None:
    """inspect() tells a limit the provider's report holds back (what was left, until when,
    reported how long ago); a report that binds nothing leaves no note; after the reset,
    none."""
    rate = Limit("held", parse_rate("10/s"))
    assert cgate.follow([rate], remaining=20, reset=1.0) == 0  # cannot bind: no note
    assert cgate.inspect(rate).held_remaining is None
    assert cgate.follow([rate], remaining=2, reset=1.0) == 1
    clock.us += 300_000
    state = cgate.inspect(rate)
    assert state.held_remaining == 2
    assert state.held == pytest.approx(0.7)
    assert state.held_since == pytest.approx(0.3)
    assert state.next_free == pytest.approx(0.5)  # its 2 starts: at 0.8 s and 0.9 s
    clock.us = T0 + 1_000_000
    after = cgate.inspect(rate)
    assert (after.held_remaining, after.held, after.held_since) == (None, 0.0, 0.0)


@pytest.mark.parametrize(("remaining", "reset"), [(-1, 1.0), (1.5, 1.0), (1, -1.0),
                                                  (1, float("nan"))])
def test_a_report_rejects_bad_values(cgate: Gate, remaining: object, reset: object) -> None:
    """Negative or fractional units, negative or NaN seconds: a ValueError naming the value."""
    with pytest.raises(ValueError, match="invalid"):
        cgate.follow([Limit("x", parse_rate("1/s"))], remaining=remaining,  # type: ignore[arg-type]
                     reset=reset)  # type: ignore[arg-type]


def test_a_renewal_after_the_release_takes_no_seat(gate: Gate) -> None:
    """The heartbeat renews a run's seats just as the run gives them back: the freed seat
    stays free (a renewal that came second would hold it for nobody a whole lease)."""
    from celery_throttle.core import heartbeat

    one = Concurrency("solo", 1)
    assert gate.acquire_many([one], holder="t1").allowed
    held = heartbeat.hold(gate, [one], "t1")
    heartbeat.release(held)
    heartbeat._heartbeat._renew(held)  # the beat had read the run's seats before the release
    assert gate.inspect_leases(one).held == 0


def test_a_renewal_after_a_holder_stops_its_beat_takes_no_seat(gate: Gate) -> None:
    """A caller waiting in place stops the beat, then gives its seat back itself: a
    renewal that came after the stop takes nothing."""
    from celery_throttle.core import heartbeat

    one = Concurrency("solo", 1)
    assert gate.acquire_many([one], holder="t1").allowed
    held = heartbeat.hold(gate, [one], "t1")
    heartbeat.stop(held)
    assert gate.release([one], "t1") == 1
    heartbeat._heartbeat._renew(held)
    assert gate.inspect_leases(one).held == 0


def test_0_1_0_s_names_still_work_with_a_deprecation_warning() -> None:
    """0.1.0 named a concurrency limit's seats ``slots`` and a booked start a ``slot``: code
    written for it keeps working, each use warned; a limit given both names, or neither, is
    refused."""
    with pytest.warns(DeprecationWarning, match=r"Concurrency\(slots=\.\.\.\) is deprecated"):
        old = Concurrency("x", slots=2)
    assert old == Concurrency("x", 2)
    with pytest.warns(DeprecationWarning, match="Concurrency.slots is deprecated"):
        assert old.slots == 2
    with pytest.raises(TypeError, match="not both"):
        Concurrency("x", 2, slots=2)
    with pytest.raises(TypeError, match="needs seats"):
        Concurrency("x")
    booked = Reservation(T0, booked=1, epoch=T0)
    with pytest.warns(DeprecationWarning, match="Reservation.slot is deprecated"):
        assert booked.slot == T0
    with pytest.warns(DeprecationWarning, match="Decision.slot is deprecated"):
        assert Decision(False, 0.5, reservation=booked).slot == T0
