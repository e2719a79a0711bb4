"""The errors a task meets (errors.py): reading a provider's 429, and errors that survive
every result backend."""

from __future__ import annotations

import datetime as dt
import email.utils
import pickle

import anthropic
import httpx
import httpx2
import openai
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
    """A 429 raises RateLimited with the header's wait; a success passes; an overloaded 503
    is held off, at least as long as its header says (at most the same cap)."""
    with pytest.raises(RateLimited) as caught:
        check_response(_Response(429, headers))
    assert caught.value.retry_after == seconds
    assert not caught.value.overloaded
    check_response(_Response(200, headers))
    with pytest.raises(RateLimited) as caught:
        check_response(_Response(503, headers))
    assert caught.value.overloaded
    named = seconds if headers and seconds != 1.0 else 0.0
    assert caught.value.retry_after >= named



def test_check_response_reads_an_http_date() -> None:
    """Retry-After may be an HTTP date (RFC 9110)."""
    when = email.utils.format_datetime(
        dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30), usegmt=True)
    with pytest.raises(RateLimited) as caught:
        check_response(_Response(429, {"Retry-After": when}))
    assert 28 <= caught.value.retry_after <= 30



@pytest.mark.parametrize("bad", [-1, float("nan"), True])
def test_rate_limited_rejects_bad_waits(bad: object) -> None:
    """The error names the value."""
    with pytest.raises(ValueError, match="invalid retry_after"):
        RateLimited(bad)


def _refusals() -> list[object]:
    """A 429 with retry-after-ms 1372, as each SDK and HTTP package raises or returns it."""
    headers = {"retry-after-ms": "1372", "retry-after": "2"}
    req2 = httpx2.Request("POST", "http://127.0.0.1/v1/chat/completions")
    req1 = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    return [
        openai.RateLimitError("rate limited", response=httpx2.Response(
            429, headers=headers, request=req2), body=None),
        anthropic.RateLimitError("rate limited", response=httpx2.Response(
            429, headers=headers, request=req2), body=None),
        httpx.HTTPStatusError("429", request=req1, response=httpx.Response(
            429, headers=headers, request=req1)),
        httpx2.Response(429, headers=headers, request=req2),
    ]


@pytest.mark.parametrize("refusal", _refusals(), ids=lambda r: type(r).__name__)
def test_check_response_and_rate_limited_read_the_sdks_errors(refusal: object) -> None:
    """openai's and anthropic's RateLimitError, httpx's HTTPStatusError and an httpx2
    response: the provider's retry-after-ms is read (1.372 s), not a default."""
    with pytest.raises(RateLimited) as caught:
        check_response(refusal)
    assert caught.value.retry_after == 1.372
    assert RateLimited(refusal).retry_after == 1.372


@pytest.mark.parametrize("unreadable", [ValueError("boom"), object(), [3], {"status": 429}])
def test_an_unreadable_refusal_is_an_error_naming_its_type(unreadable: object) -> None:
    """No HTTP status to read: a TypeError naming the type, never a silent 1 s pause."""
    name = type(unreadable).__name__
    with pytest.raises(TypeError, match=f"'{name}'"):
        check_response(unreadable)
    with pytest.raises(TypeError, match=f"'{name}'"):
        RateLimited(unreadable)



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
