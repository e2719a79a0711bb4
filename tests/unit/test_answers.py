"""Reading a provider's answer (answers.py): recorded bodies and the real SDKs' errors.

The bodies are the providers' own (as the mock provider gives them,
``examples.provider.ANSWERS``, and as recorded from their APIs); the SDK
errors are made by the real ``openai`` and ``anthropic`` clients from an
answer, as they make them for a call.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from celery_throttle import RateLimited, check_response
from celery_throttle.answers import (
    MAX_BODY,
    OVERLOAD_FIRST,
    OVERLOAD_MOST,
    Answer,
    Backoff,
    classify,
)
from examples.provider import ANSWERS

#: OpenAI's rate-limit 429 (recorded): a quota, though its message links the billing page.
OPENAI_RATE = (429, {"error": {
    "message": "Rate limit reached for gpt-4o in organization org-x on requests per min "
               "(RPM): Limit 3, Used 3, Requested 1. Please try again in 20s. Visit "
               "https://platform.openai.com/account/rate-limits to learn more. You can "
               "increase your rate limit by adding a payment method to your account at "
               "https://platform.openai.com/account/billing.",
    "type": "requests", "param": None, "code": "rate_limit_exceeded"}})
#: Anthropic's rate-limit 429 (recorded).
ANTHROPIC_RATE = (429, {"type": "error", "error": {
    "type": "rate_limit_error",
    "message": "This request would exceed the rate limit for your organization of 50 "
               "requests per minute."}})
#: Anthropic's 400 when the prepaid credits are spent (recorded).
ANTHROPIC_CREDIT = (400, {"type": "error", "error": {
    "type": "invalid_request_error",
    "message": "Your credit balance is too low to access the Anthropic API. Please go to "
               "Plans & Billing to upgrade or purchase credits."}})
#: LiteLLM's proxy once a key's budget is spent.
LITELLM_BUDGET = (400, {"error": {"message": "Budget has been exceeded! Current cost: 41.2, "
                                             "Max budget: 40.0", "type": "budget_exceeded",
                                  "param": None, "code": "400"}})
#: An ordinary bad request (a body the provider refuses): nothing about the quota.
BAD_REQUEST = (400, {"type": "error", "error": {
    "type": "invalid_request_error", "message": "max_tokens: Field required"}})


def _answer(kind: str, path: str = "") -> tuple[int, dict[str, Any] | None]:
    shapes = ANSWERS[kind]
    return shapes.get(path, shapes[""])


def _body(body: dict[str, Any] | None) -> bytes:
    return json.dumps(body).encode() if body is not None else b""


@pytest.mark.parametrize(("answer", "headers", "expected"), [
    (OPENAI_RATE, {"retry-after-ms": "1372"}, ("quota", 1.372)),
    (ANTHROPIC_RATE, {"retry-after": "7"}, ("quota", 7.0)),
    (_answer("bare"), {}, ("quota", 1.0)),
    (_answer("insufficient_quota"), {}, ("money", None)),
    (_answer("spend_cap"), {}, ("money", None)),
    (_answer("usage_limit"), {}, ("money", None)),
    (ANTHROPIC_CREDIT, {}, ("money", None)),
    (LITELLM_BUDGET, {}, ("money", None)),
    ((402, None), {}, ("money", None)),
    (_answer("overloaded", "/v1/messages"), {}, ("overloaded", None)),
    (_answer("overloaded", "/v1/chat/completions"), {"retry-after": "5"}, ("overloaded", 5.0)),
    (BAD_REQUEST, {}, None),
    ((500, {"error": {"message": "internal", "type": "server_error"}}), {}, None),
    ((200, {"choices": []}), {}, None),
], ids=["openai-rate", "anthropic-rate", "bare-429", "insufficient_quota", "spend-cap-429",
        "usage-limit-400", "credit-balance-400", "litellm-budget", "402", "529", "503",
        "bad-request", "500", "200"])
def test_each_answer_is_read_for_what_it_means(
        answer: tuple[int, dict[str, Any] | None], headers: dict[str, str],
        expected: tuple[str, float | None] | None) -> None:
    """Quota (with the provider's retry-after, 1 s without), money (which no retry-after
    clears), overload, or nothing: from the status and the recorded body."""
    status, body = answer
    found = classify(status, headers, _body(body))
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert (found.kind, found.retry_after) == expected
    if found.kind == "money" and body is not None:
        assert found.message  # (the provider's words, for the operator)
        assert found.message in json.dumps(body)


def test_a_body_already_decoded_or_as_text_reads_the_same() -> None:
    """An SDK's decoded ``body``, the raw bytes and the text: the same answer."""
    status, body = _answer("insufficient_quota")
    expected = classify(status, {}, _body(body))
    assert classify(status, {}, body) == expected
    assert classify(status, {}, _body(body).decode()) == expected
    assert expected is not None
    assert expected.kind == "money"


def test_a_long_message_is_cut_and_a_huge_body_is_not_read() -> None:
    """The message kept is bounded; a body past MAX_BODY is no error's: its status decides."""
    long = {"error": {"type": "insufficient_quota", "message": "x" * 5000}}
    found = classify(429, {}, long)
    assert found is not None
    assert len(found.message) == 300
    huge = json.dumps(long).encode() + b" " * MAX_BODY
    assert classify(429, {}, huge) == Answer("quota", 1.0, "")


def test_a_hook_reads_a_provider_s_own_signals_first() -> None:
    """A 200 whose JSON says "rate limited" is a quota by the hook; the hook's None leaves
    the answer to the reading here; a word the hook makes up is an error naming it."""
    def hook(status: int, headers: Any, body: Any) -> Any:
        if isinstance(body, dict) and body.get("status") == "rate_limited":
            return "quota"
        return None

    assert classify(200, {"retry-after": "3"}, b'{"status": "rate_limited"}',
                    hook) == Answer("quota", 3.0, "", named=True)
    status, body = _answer("spend_cap")
    money = classify(status, {}, body, hook)
    assert money is not None
    assert money.kind == "money"
    with pytest.raises(ValueError, match="'later'"):
        classify(200, {}, b"{}", lambda *_: "later")  # type: ignore[arg-type]


def _sdk_error(sdk: str, status: int, body: dict[str, Any] | None,
               headers: dict[str, str] | None = None) -> Exception:
    """The error the real SDK makes of this answer (its own status -> class mapping)."""
    request = httpx2.Request("POST", "http://127.0.0.1/v1/x")
    response = httpx2.Response(status, headers=headers or {}, content=_body(body),
                               request=request)
    client: Any = (openai.OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1")
                   if sdk == "openai" else
                   anthropic.Anthropic(api_key="k", base_url="http://127.0.0.1:9"))
    try:
        error: Exception = client._make_status_error_from_response(response)
    finally:
        client.close()
    return error


def test_check_response_reads_the_sdks_errors_for_what_they_say() -> None:
    """The SDKs' own errors: a quota 429 re-schedules the task (RateLimited, the provider's
    retry-after); an overloaded answer (anthropic's OverloadedError, 529) too, as an
    overload: held off for the back-off, its quota not paused."""
    status, body = OPENAI_RATE
    error = _sdk_error("openai", status, body, {"retry-after-ms": "250"})
    assert isinstance(error, openai.RateLimitError)
    with pytest.raises(RateLimited) as caught:
        check_response(error)
    assert caught.value.retry_after == 0.25
    overloaded = _sdk_error("anthropic", *_answer("overloaded", "/v1/messages"))
    assert type(overloaded).__name__ == "OverloadedError"
    with pytest.raises(RateLimited) as caught:
        check_response(overloaded)
    assert caught.value.overloaded
    assert caught.value.stop is None
    # (the process's back-off: 1 s first, longer after other overloads in a row here)
    assert OVERLOAD_FIRST <= caught.value.retry_after <= OVERLOAD_MOST * 1.25


def test_the_back_off_doubles_in_a_row_is_capped_and_a_success_resets_it() -> None:
    """1 s, 2 s, 4 s... (times a jitter of 1 to 1.25), at most OVERLOAD_MOST; never less than
    the provider's retry-after; from 1 s again after a success."""
    backoff = Backoff()
    waits = [backoff.next() for _ in range(8)]
    for n, wait in enumerate(waits):
        base = min(OVERLOAD_MOST, OVERLOAD_FIRST * 2 ** n)
        assert base <= wait <= base * 1.25
    assert backoff.next(named=100.0) == 100.0
    backoff.reset()
    assert OVERLOAD_FIRST <= backoff.next() <= OVERLOAD_FIRST * 1.25
