"""The errors a task meets (errors.py): reading a provider's 429, and errors that survive
every result backend."""

from __future__ import annotations

import datetime as dt
import email.utils
import pickle

import pytest

from celery_throttle import Concurrency, Limit, RateLimited, check_response, parse_rate


def test_throttle_timeout_survives_json_and_pickle() -> None:
    """ThrottleTimeout re-creates from its message (Celery's JSON backend) and pickles whole."""
    import pickle

    from celery_throttle import ThrottleTimeout

    exc = ThrottleTimeout.exceeded("app.job", "openai", 12.5, 10.0)
    assert str(ThrottleTimeout(*exc.args)) == str(exc)
    again = pickle.loads(pickle.dumps(exc))
    assert (again.task_name, again.limit_name, again.waited, again.max_wait) == (
        "app.job", "openai", 12.5, 10.0)
    assert "would wait 12.500s for limit 'openai', past its max_wait of 10.000s" in str(again)


class _Response:
    """The shape of an httpx/requests response (status_code, headers)."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code = status
        self.headers = headers



@pytest.mark.parametrize(("headers", "seconds"), [
    ({"Retry-After": "3"}, 3.0),
    ({"retry-after": "0.5"}, 0.5),
    ({"Retry-After": "3", "retry-after-ms": "2500"}, 2.5),  # the finer header wins
    ({}, 1.0),  # no header: 1 s
    ({"Retry-After": "soon"}, 1.0),  # unreadable: 1 s
    ({"Retry-After": "86400000"}, 3600.0),  # capped at an hour
])
def test_check_response_reads_retry_after(headers: dict[str, str], seconds: float) -> None:
    """A 429 raises RateLimited with the header's wait; anything else passes."""
    with pytest.raises(RateLimited) as caught:
        check_response(_Response(429, headers))
    assert caught.value.retry_after == seconds
    check_response(_Response(200, headers))
    check_response(_Response(503, headers))



def test_check_response_reads_an_http_date() -> None:
    """Retry-After may be an HTTP date (RFC 9110)."""
    when = email.utils.format_datetime(
        dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30), usegmt=True)
    with pytest.raises(RateLimited) as caught:
        check_response(_Response(429, {"Retry-After": when}))
    assert 28 <= caught.value.retry_after <= 30



@pytest.mark.parametrize("bad", [-1, float("nan"), True, [3]])
def test_rate_limited_rejects_bad_waits(bad: object) -> None:
    """The error names the value."""
    with pytest.raises(ValueError, match="invalid retry_after"):
        RateLimited(bad)  # type: ignore[arg-type]



def test_rate_limited_survives_pickle_and_json_backends() -> None:
    """Re-created by pickle with its fields, and from its message alone (JSON backends)."""
    exc = RateLimited(2.5, limits=["llm"])
    again = pickle.loads(pickle.dumps(exc))
    assert (again.retry_after, again.limits) == (2.5, ("llm",))
    assert str(RateLimited(str(exc))) == str(exc)



def test_rate_limited_picks_named_limits() -> None:
    """Named limits are paused alone; naming an unknown one is an error listing the known."""
    a, b = Limit("a", parse_rate("1/s")), Concurrency("b", 2)
    assert RateLimited(1).limits_in([a, b]) == [a, b]
    assert RateLimited(1, limits=["b"]).limits_in([a, b]) == [b]
    with pytest.raises(ValueError, match=r"names limits \['c'\].*\['a', 'b'\]"):
        RateLimited(1, limits=["c"]).limits_in([a, b])
