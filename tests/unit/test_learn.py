"""The learned rate (lua/learn.lua) on a real Redis and a caller clock: one test per rule."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import redis

from celery_throttle import Gate, Limit, parse_rate
from celery_throttle.core.keys import learned_key

from ..clock import T0, StepClock

CEILING = Limit("llm", parse_rate("10/s"), adaptive=True)  # K = 18 s, BETA = 0.85 (learn.lua)


def learned(gate: Gate, lim: Limit = CEILING) -> float:
    """The rate ``lim`` decides at now (starts a second)."""
    state = gate.inspect(lim).learned
    assert state is not None
    return state.rate


def use(gate: Gate, clock: StepClock, seconds: float, share: float = 1.0,
        lim: Limit = CEILING) -> int:
    """Start as often as ``share`` of the learned rate allows for ``seconds`` of the clock
    (1.0: every start the limit admits); the starts made."""
    end, starts = clock.us + round(seconds * 1e6), 0
    for _ in range(100_000):
        if clock.us >= end:
            return starts
        decision = gate.acquire_many([lim])
        if decision.allowed:
            starts += 1
            clock.us += round(1e6 / learned(gate, lim) / share) if share < 1 else 0
        else:
            clock.us += max(1, round(decision.retry_after * 1e6))
    raise AssertionError("the loop did not reach the end of the span")


def refused(gate: Gate, lim: Limit = CEILING, sent_ago: float = 0.0,
            retry_after: float = 0.0) -> float:
    """The provider refused, for its quota, a request sent ``sent_ago`` seconds ago."""
    return gate.pause([lim], retry_after, refused_after=sent_ago)


def test_a_limit_that_learns_starts_at_its_ceiling(cgate: Gate) -> None:
    """Nothing learned yet: it decides at its rate, and says no move was made."""
    state = cgate.inspect(CEILING).learned
    assert state is not None
    assert (state.rate, state.why, state.before) == (10.0, "", 0.0)
    assert cgate.acquire_many([CEILING]).allowed
    assert cgate.acquire_many([CEILING]).retry_after == pytest.approx(0.1)
    fixed = Limit("llm", parse_rate("10/s"))  # (the same bucket, a fixed rate)
    assert cgate.inspect(fixed).learned is None


def test_a_quota_refusal_cuts_by_beta_and_spends_the_burst(
        cgate: Gate, clock: StepClock) -> None:
    """A cut: 10/s -> 8.5/s, said with why and the rate before; even a limit with a burst
    of 5 makes its next start one new interval away; no pause without a Retry-After."""
    lim = dataclasses.replace(CEILING, burst=5)
    assert refused(cgate, lim) == 0.0
    state = cgate.inspect(lim).learned
    assert state is not None
    assert state.rate == pytest.approx(8.5, rel=1e-5)
    assert (state.why, state.before, state.since) == ("cut", 10.0, 0.0)
    decision = cgate.acquire_many([lim])
    assert not decision.allowed
    assert decision.retry_after == pytest.approx(1 / 8.5, abs=2e-6)
    assert cgate.inspect(lim).paused == 0.0
    clock.us += 3_000_000
    assert cgate.inspect(lim).learned.since == 3.0  # type: ignore[union-attr]


def test_a_refusal_of_a_request_sent_before_the_last_cut_does_not_cut_again(
        cgate: Gate, clock: StepClock) -> None:
    """Requests in flight at the old rate are answered by one cut; a request admitted
    after the cut and still refused cuts again and, so soon after the last, holds the
    limit for a second."""
    refused(cgate)
    clock.us += 50_000
    refused(cgate, sent_ago=0.1)  # (admitted 50 ms before the cut)
    assert learned(cgate) == pytest.approx(8.5, rel=1e-5)
    refused(cgate, sent_ago=0.01)  # (admitted 40 ms after it)
    assert learned(cgate) == pytest.approx(8.5 * 0.85, rel=1e-5)
    assert cgate.acquire_many([CEILING]).retry_after == pytest.approx(
        1 + 1 / (8.5 * 0.85), abs=2e-6)
    clock.us += 3_000_000
    refused(cgate)  # (3 s after the last cut: one new interval, no hold)
    assert cgate.acquire_many([CEILING]).retry_after == pytest.approx(
        1 / learned(cgate), abs=2e-6)


def test_used_it_climbs_back_to_the_rate_of_the_cut_in_k_seconds_of_use(
        cgate: Gate, clock: StepClock) -> None:
    """After a cut from 10/s, 18 s of full use brings the rate back to about 10/s: fast at
    first, flat near the old rate (the cubic's shape)."""
    refused(cgate)
    use(cgate, clock, 3.0)
    early = learned(cgate)
    use(cgate, clock, 8.0)
    middle = learned(cgate)
    use(cgate, clock, 8.0)
    late = learned(cgate)
    assert 8.5 < early < 9.5
    assert middle - early > late - middle > 0  # (concave: slowing down near the rate)
    assert 9.9 <= late <= 10.0
    state = cgate.inspect(CEILING).learned
    assert state is not None
    assert state.why == "raise"


def test_an_idle_or_half_idle_limit_does_not_climb(cgate: Gate, clock: StepClock) -> None:
    """A minute without starts, then use at 40 % of the learned rate: no raise; at 60 %
    of it, a raise."""
    refused(cgate)
    clock.us += 60_000_000
    use(cgate, clock, 5.0, share=0.4)
    assert learned(cgate) == pytest.approx(8.5, rel=1e-5)
    use(cgate, clock, 5.0, share=0.6)
    assert learned(cgate) > 8.6


def test_it_never_goes_above_its_ceiling(cgate: Gate, clock: StepClock) -> None:
    """A minute of full use after a cut: at the ceiling, never over it; and with no cut
    ever, the ceiling from the first start."""
    refused(cgate)
    starts = use(cgate, clock, 60.0)
    assert learned(cgate) == 10.0
    assert starts <= 60 * 10 + 1


def test_it_never_goes_below_its_floor(cgate: Gate) -> None:
    """Cuts on cuts stop at the floor: a tenth of the rate by default, or the one given."""
    for _ in range(20):
        refused(cgate)
    assert learned(cgate) == pytest.approx(1.0)
    floored = Limit("floored", parse_rate("10/s"), adaptive=True, floor=parse_rate("5/s"))
    for _ in range(5):
        refused(cgate, floored)
    assert learned(cgate, floored) == pytest.approx(5.0)


def test_a_live_rate_moves_the_ceiling_and_the_climb_goes_on_from_there(
        cgate: Gate, clock: StepClock) -> None:
    """A set rate is the ceiling: under the learned rate, it decides at once; raised
    over the old ceiling, use climbs past it."""
    refused(cgate)
    lower = dataclasses.replace(CEILING, rate=parse_rate("5/s"))
    assert learned(cgate, lower) == pytest.approx(5.0)
    assert learned(cgate) == pytest.approx(8.5, rel=1e-5)  # (the code's ceiling again)
    higher = dataclasses.replace(CEILING, rate=parse_rate("20/s"))
    use(cgate, clock, 40.0, lim=higher)
    assert learned(cgate, higher) > 10.5


def test_the_learned_rate_outlives_its_bucket(cgate: Gate, client: redis.Redis,
                                              prefix: str) -> None:
    """The bucket's key goes when it drains; the learned rate stays a week after its
    last write."""
    refused(cgate)
    cgate.acquire_many([CEILING])
    client.delete(CEILING.key_in(prefix))
    assert learned(cgate) == pytest.approx(8.5, rel=1e-5)
    assert client.pttl(learned_key(prefix, "llm")) > 6 * 86400 * 1000


def test_a_limit_that_does_not_learn_is_not_cut(cgate: Gate) -> None:
    """A refusal without a wait leaves a fixed limit alone; with one, it pauses both
    kinds, and cuts the one that learns."""
    fixed = Limit("fixed", parse_rate("10/s"))
    assert refused(cgate, fixed) == 0.0
    assert cgate.acquire_many([fixed]).allowed
    assert cgate.pause([fixed, CEILING], 2.0, refused_after=0.0) == 2.0
    assert cgate.inspect(fixed).paused == 2.0
    assert cgate.inspect(CEILING).paused == 2.0
    assert learned(cgate) == pytest.approx(8.5, rel=1e-5)


def test_an_operators_pause_cuts_nothing(cgate: Gate) -> None:
    """A pause that is no refusal (an operator's, a stop) leaves the learned rate."""
    assert cgate.pause([CEILING], 1.0) == 1.0
    assert learned(cgate) == 10.0


def test_a_report_follows_a_limit_that_learns(cgate: Gate) -> None:
    """The provider's remaining count binds a limit that learns as any (its side key
    does not shift the command's own keys)."""
    cgate.follow([CEILING], 0, 5.0)
    state = cgate.inspect(CEILING)
    assert state.held_remaining == 0
    assert state.next_free == pytest.approx(5.0, abs=0.15)


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"floor": "1/s"}, ValueError, "no learning: give adaptive=True"),
    ({"adaptive": True, "floor": "20/s"}, ValueError, "invalid floor '20/s': above the rate"),
    ({"adaptive": 1}, TypeError, "expected True or False"),
])
def test_bad_learning_options_are_refused_by_name(options: dict[str, object],
                                                  error: type[Exception], words: str) -> None:
    """A floor without learning, a floor above the rate, a non-bool adaptive."""
    with pytest.raises(error, match=words):
        Limit("llm", parse_rate("10/s"), **options)  # type: ignore[arg-type]


def test_a_cut_and_a_climb_past_a_tenth_are_said_once_at_info(
        cgate: Gate, clock: StepClock, caplog: pytest.LogCaptureFixture) -> None:
    """The cut is logged by the caller that made it; the climb back from 8.5/s to 10/s
    once, when it passes a tenth over the rate said last."""
    caplog.set_level(logging.INFO, logger="celery_throttle")
    refused(cgate)
    use(cgate, clock, 20.0)
    lines = [r.getMessage() for r in caplog.records if "learned rate" in r.getMessage()]
    assert lines[0] == ("throttle: learned rate of llm cut from 10/s to 8.5/s (the provider "
                        "refused a request for its quota)")
    assert len(lines) == 2, lines
    assert lines[1].startswith("throttle: learned rate of llm raised from 8.5/s to 9.")
    assert lines[1].endswith("(used while the provider accepted)")


def test_a_reset_forgets_what_it_learned(cgate: Gate) -> None:
    """Reset: the bucket and the learned rate go; it decides at its ceiling again."""
    refused(cgate)
    assert cgate.reset(CEILING)
    assert learned(cgate) == 10.0


def test_starts_booked_before_a_held_cut_move_past_the_hold(cgate: Gate,
                                                            clock: StepClock) -> None:
    """A start booked at the old rate, claimed after a cut that holds the limit, is early
    until the hold has passed: the provider's window empties before it is sent."""
    cgate.acquire_many([CEILING])
    booked = cgate.acquire_many([CEILING], reserve=5)
    assert booked.start == T0 + 100_000
    refused(cgate)
    refused(cgate)  # (a cut soon after the last: a hold of a second)
    clock.us = T0 + 100_000
    claimed = cgate.acquire_many([CEILING], claim=booked.reservation, grace=0.02)
    assert claimed.early
    assert claimed.retry_after == pytest.approx(1.0)
