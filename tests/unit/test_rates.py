"""The rate grammar: Celery's forms plus days and period multiples; clear errors otherwise."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_throttle import Limit, Rate, parse_rate


@pytest.mark.parametrize(
    ("text", "count", "period", "interval_us"),
    [
        ("10/s", Fraction(10), 1, 100_000),
        ("100/m", Fraction(100), 60, 600_000),
        ("2/h", Fraction(2), 3600, 1_800_000_000),
        ("0.5/s", Fraction(1, 2), 1, 2_000_000),
        ("1000/d", Fraction(1000), 86400, 86_400_000),
        ("5/10s", Fraction(5), 10, 2_000_000),
        ("90000/m", Fraction(90000), 60, 667),  # 666.67 us rounded up: never faster
        (" 60 / m ", Fraction(60), 60, 1_000_000),
    ],
)
def test_parses_good_rates(text: str, count: Fraction, period: int, interval_us: int) -> None:
    """Each accepted form gives the exact count, period and a rounded-up interval."""
    rate = parse_rate(text)
    assert (rate.count, rate.period, rate.interval_us) == (count, period, interval_us)


@pytest.mark.parametrize(
    "bad", ["ten/s", "0/s", "-1/s", "10/x", "", "10", None, "10/0s", "1/s/s", 10, "nan/s"]
)
def test_rejects_bad_rates_naming_the_value(bad: object) -> None:
    """A bad rate raises ValueError whose text names the value and shows the expected form."""
    with pytest.raises(ValueError, match="invalid rate") as info:
        parse_rate(bad)
    assert repr(bad) in str(info.value)
    assert "'10/s'" in str(info.value)


def test_rate_repr_and_passthrough() -> None:
    """A Rate shows its text and parse_rate returns an existing Rate unchanged."""
    rate = parse_rate("5/10s")
    assert repr(rate) == "Rate('5/10s')"
    assert parse_rate(rate) is rate
    assert isinstance(rate, Rate)
    assert rate.per_second == 0.5


@pytest.mark.parametrize(("burst", "cost"), [(0, 1), (-1, 1), (1, 0), (2, -3), (True, 1)])
def test_limit_rejects_burst_or_cost_below_one(burst: int, cost: int) -> None:
    """Burst and cost must be integers >= 1; the error names the bad value."""
    with pytest.raises(ValueError, match=r"invalid (burst|cost)"):
        Limit("api", parse_rate("1/s"), burst=burst, cost=cost)


def test_limit_rejects_cost_above_burst() -> None:
    """A cost above the burst could never pass: a clear error instead of waiting forever."""
    with pytest.raises(ValueError, match="cost 6 exceeds burst 5 of limit 'api'"):
        Limit("api", parse_rate("1/s"), burst=5, cost=6)


rate_like = st.one_of(
    st.text(max_size=20),
    st.from_regex(r"\s*-?[0-9]{0,6}(\.[0-9]{0,4})?\s*/\s*[0-9]{0,4}[smhdx]?\s*", fullmatch=True),
    st.integers(), st.floats(), st.none(),
)


@settings(max_examples=500, deadline=None)
@given(value=rate_like)
def test_any_rate_value_parses_exactly_or_names_itself(value: object) -> None:
    """Any input: a Rate whose interval is never shorter than the asked one, or a ValueError."""
    try:
        rate, error = parse_rate(value), ""
    except ValueError as exc:
        rate, error = None, str(exc)
    if rate is None:
        assert repr(value) in error
        return
    assert isinstance(value, str)
    assert rate.count > 0
    assert rate.period > 0
    assert rate.interval_us >= 1
    assert rate.interval_us * rate.count >= rate.period * 1_000_000  # rounded up: never faster
    assert parse_rate(str(rate)).interval_us == rate.interval_us  # its text reads back the same


@given(burst=st.one_of(st.integers(-5, 10**6), st.booleans(), st.floats(), st.text(max_size=3)),
       cost=st.one_of(st.integers(-5, 10**6), st.booleans(), st.floats()))
def test_any_burst_and_cost_are_valid_or_named(burst: object, cost: object) -> None:
    """Burst and cost: integers with 1 <= cost <= burst, else a ValueError naming the value."""
    try:
        lim, error = Limit("api", parse_rate("1/s"), burst=burst, cost=cost), ""  # type: ignore[arg-type]
    except ValueError as exc:
        lim, error = None, str(exc)
    if lim is None:
        assert repr(burst) in error or repr(cost) in error
        return
    assert isinstance(lim.burst, int)
    assert isinstance(lim.cost, int)
    assert 1 <= lim.cost <= lim.burst


def test_one_declaration_makes_a_rate_a_seat_limit_or_both_in_that_order() -> None:
    """Gate.limit, @throttled and the worker's listing of known limits make their limits
    by one rule (core.limits.declared)."""
    from celery_throttle.core.limits import Concurrency, Limit, declared

    both = declared("api", "5/s", 3, "tenant-1", 2, concurrency=4, lease=30.0, fair="t")
    assert [type(lim) for lim in both] == [Limit, Concurrency]
    rate, seats = both
    assert isinstance(rate, Limit)
    assert (rate.name, rate.burst, rate.key, rate.cost, rate.fair) == ("api", 3, "tenant-1", 2,
                                                                       "t")
    assert isinstance(seats, Concurrency)
    assert (seats.name, seats.seats, seats.key, seats.lease) == ("api", 4, "tenant-1", 30.0)
    assert [type(lim) for lim in declared("api", None, concurrency=1)] == [Concurrency]
    with pytest.raises(ValueError, match="give a rate, a concurrency, or both"):
        declared("api", None)
