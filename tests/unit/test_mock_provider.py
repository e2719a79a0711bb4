"""The mock provider (``examples/provider.py``) gives on demand the answers real providers give."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from examples.provider import ANSWERS, MockProvider


@pytest.fixture
def provider() -> Iterator[MockProvider]:
    """A mock provider on a free loopback port, 5 requests per second."""
    served = MockProvider(limit=5, window=1.0, latency=0.0).start()
    try:
        yield served
    finally:
        served.stop()


def _post(provider: MockProvider, path: str) -> tuple[int, dict[str, str], bytes]:
    """POST one small request to ``path``: (status, headers, body), whatever the status."""
    body = json.dumps({"model": "mock", "prompt": "hi",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"{provider.url}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _rate_headers(headers: dict[str, str]) -> list[str]:
    return [h for h in headers if "ratelimit" in h.lower() or h.lower().startswith("retry-after")]


@pytest.mark.parametrize(("kind", "path", "status", "error_type"), [
    ("overloaded", "/v1/messages", 529, "overloaded_error"),
    ("overloaded", "/v1/chat/completions", 503, "server_error"),
    ("insufficient_quota", "/v1/chat/completions", 429, "insufficient_quota"),
    ("spend_cap", "/v1/messages", 429, "rate_limit_error"),
    ("usage_limit", "/v1/messages", 400, "invalid_request_error"),
])
def test_an_answer_on_demand_is_the_provider_s_own(
    provider: MockProvider, kind: str, path: str, status: int, error_type: str
) -> None:
    """Each answer comes with its provider's status and error body, no rate-limit header
    and no Retry-After (none of these clears by waiting a second), for the next request
    only; it is counted as a refusal of its kind, and the quota is untouched."""
    provider.answer_with(kind, count=1)
    got, headers, raw = _post(provider, path)
    assert got == status
    body: dict[str, Any] = json.loads(raw)
    assert body["error"]["type"] == error_type
    assert _rate_headers(headers) == []
    assert provider.refusals[-1][1] == kind
    assert provider.accepted == []
    assert _post(provider, path)[0] == 200  # (count=1: the next is decided again)


def test_a_bare_429_carries_no_header_and_no_json(provider: MockProvider) -> None:
    """The bare answer is a 429 with a plain-text body and no rate-limit or retry header,
    as a proxy sends it."""
    provider.answer_with("bare", count=2)
    for path in ("/v1/chat/completions", "/v1/summarize"):
        got, headers, raw = _post(provider, path)
        assert (got, raw) == (429, b"Too Many Requests")
        assert _rate_headers(headers) == []
    assert [why for _, why in provider.refusals] == ["bare", "bare"]


def test_an_answer_for_a_while_then_the_quota_again(provider: MockProvider) -> None:
    """For ``seconds``, every request gets the answer; after them, the quota decides."""
    provider.answer_with("overloaded", seconds=0.3)
    assert {_post(provider, "/v1/messages")[0] for _ in range(3)} == {529}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _post(provider, "/v1/messages")[0] == 529:
        time.sleep(0.05)
    assert _post(provider, "/v1/messages")[0] == 200
    provider.answer_with("overloaded", count=5)
    provider.answer_with(None)
    assert _post(provider, "/v1/messages")[0] == 200


def test_answers_are_named_and_given_one_way(provider: MockProvider) -> None:
    """An unknown answer, or neither or both of count and seconds, is refused by name."""
    with pytest.raises(ValueError, match="unknown answer 'teapot'"):
        provider.answer_with("teapot", count=1)
    with pytest.raises(ValueError, match="count or seconds"):
        provider.answer_with("bare")
    with pytest.raises(ValueError, match="count or seconds"):
        provider.answer_with("bare", count=1, seconds=1.0)
    assert set(ANSWERS) == {"overloaded", "insufficient_quota", "spend_cap", "usage_limit",
                            "bare"}


def test_the_quota_changes_while_it_serves(provider: MockProvider) -> None:
    """``set_limit`` takes effect at the next request: 5 per second, then 2."""
    assert [_post(provider, "/v1/summarize")[0] for _ in range(6)] == [200] * 5 + [429]
    provider.reset()
    provider.set_limit(2)
    assert [_post(provider, "/v1/summarize")[0] for _ in range(3)] == [200, 200, 429]
    with pytest.raises(ValueError, match="a quota of 0"):
        provider.set_limit(0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_without_rate_headers_only_the_retry_after_of_a_quota_429_is_left(
    path: str
) -> None:
    """``rate_headers=False``: no x-ratelimit-*/anthropic-ratelimit-* header on any answer;
    a quota refusal still says when to come back, as HTTP's Retry-After."""
    served = MockProvider(limit=1, window=5.0, latency=0.0, rate_headers=False).start()
    try:
        ok, ok_headers, _ = _post(served, path)
        refused, refused_headers, _ = _post(served, path)
    finally:
        served.stop()
    assert (ok, refused) == (200, 429)
    assert _rate_headers(ok_headers) == []
    assert sorted(h.lower() for h in _rate_headers(refused_headers)) == ["retry-after",
                                                                         "retry-after-ms"]


def test_its_own_refusals_can_name_no_wait() -> None:
    """retry_after=False (and rate_headers=False): the quota's own 429s carry no header
    at all; by default they name their wait."""
    for retry_after, named in ((False, []), (True, ["retry-after", "retry-after-ms"])):
        server = MockProvider(limit=1, window=5.0, latency=0.0, rate_headers=False,
                              retry_after=retry_after).start()
        try:
            assert _post(server, "/v1/chat/completions")[0] == 200
            got, headers, _ = _post(server, "/v1/chat/completions")
            assert got == 429
            assert sorted(h for h in (k.lower() for k in headers) if "retry" in h) == named
            assert not [k for k in headers if "ratelimit" in k.lower()]
        finally:
            server.stop()
