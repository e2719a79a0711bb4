"""Reading the providers' rate-limit headers (OpenAI's durations, Anthropic's times, Azure's
unknowns)."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from celery_throttle.provider_headers import Report, duration, reports_of


@pytest.mark.parametrize(("text", "seconds"), [("6m0s", 360.0), ("293ms", 0.293), ("1s", 1.0),
                                               ("1h2m3.5s", 3723.5), ("0.5s", 0.5),
                                               ("2m30s", 150.0), ("17ms", 0.017)])
def test_openai_durations_read_as_seconds(text: str, seconds: float) -> None:
    """The duration forms OpenAI sends in x-ratelimit-reset-*."""
    assert duration(text) == pytest.approx(seconds)


def test_openai_and_anthropic_reports_are_read_in_any_case() -> None:
    """Both providers' headers, through httpx's case-insensitive headers; the Anthropic reset
    is an RFC 3339 time, read as the seconds until it."""
    soon = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30)).isoformat()
    headers = httpx.Headers({
        "X-RateLimit-Limit-Requests": "500", "X-RateLimit-Remaining-Requests": "499",
        "X-RateLimit-Reset-Requests": "120ms",
        "x-ratelimit-remaining-tokens": "149984", "x-ratelimit-reset-tokens": "6m0s",
        "anthropic-ratelimit-input-tokens-remaining": "39000",
        "anthropic-ratelimit-input-tokens-reset": soon.replace("+00:00", "Z")})
    got = reports_of(headers)
    assert got[:2] == [Report("requests", 499, 0.12), Report("tokens", 149984, 360.0)]
    assert got[2].kind == "input-tokens"
    assert got[2].remaining == 39000
    assert 28 < got[2].reset <= 30


@pytest.mark.parametrize("headers", [
    # Azure OpenAI when it does not say: -1 for the limit and what remains, 0 for the reset.
    {"x-ratelimit-limit-tokens": "-1", "x-ratelimit-remaining-tokens": "-1",
     "x-ratelimit-reset-tokens": "0"},
    {"x-ratelimit-limit-requests": "-1", "x-ratelimit-remaining-requests": "0",
     "x-ratelimit-reset-requests": "1s"},
    {"x-ratelimit-remaining-requests": "-1", "x-ratelimit-reset-requests": "1s"},
    {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "0s"},
    # Only what is left, with no reset (older Azure answers): nothing to follow.
    {"x-ratelimit-remaining-requests": "79", "x-ratelimit-remaining-tokens": "61353"},
    # A reset in the past, a format we cannot read.
    {"anthropic-ratelimit-requests-remaining": "0",
     "anthropic-ratelimit-requests-reset": "2020-01-01T00:00:00Z"},
    {"x-ratelimit-remaining-requests": "many", "x-ratelimit-reset-requests": "soon"},
])
def test_unknown_values_are_left_out_never_read_as_nothing_left(headers: dict[str, str]
                                                                ) -> None:
    """A report that says nothing is no report: following it as zero left would stop the
    limit until a reset that was never announced."""
    assert reports_of(headers) == []
