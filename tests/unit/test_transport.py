"""The gated HTTP transport (transport.py) under the real openai and anthropic SDKs.

The SDKs (test extras) send through a client from ``gated_client`` to the
mock provider (a real HTTP server on 127.0.0.1 answering in their shapes,
with their rate-limit headers), with their default retries on.  The
provider refuses everything for a while mid-run (its own trouble, a
"hold"): every retry of the refused calls must then wait for a booked start of the
limit, so no request is refused for the quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from celery import Celery, Task
from celery.exceptions import Ignore

from celery_throttle import (
    Gate,
    Limit,
    LimitStopped,
    RateLimited,
    check_response,
    parse_rate,
    throttled,
)
from celery_throttle.core import credit
from celery_throttle.integration.config import DISPATCH_LEAD
from celery_throttle.integration.runtime import forget
from celery_throttle.ops import control, report
from celery_throttle.testing import max_in_window
from celery_throttle.transport import (
    AsyncGatedTransport,
    GatedTransport,
    async_gated_client,
    gated_client,
)
from examples import provider as mock

from ..conftest import installed_app
from ..workers import PublishRecorder

#: The provider's quota: 10 requests in any 1 s; the limit below it: 9/s.
QUOTA, RATE = 10, "9/s"
HOLD = 0.6  # seconds the provider refuses everything, a second into the run


@pytest.fixture
def provider() -> Iterator[mock.MockProvider]:
    server = mock.MockProvider(limit=QUOTA, window=1.0, latency=0.02).start()
    yield server
    server.stop()


def _hold_after(provider: mock.MockProvider, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, provider.hold, args=(HOLD,))
    timer.start()
    return timer


def _in_threads(call: Callable[[int], Any], threads: int, each: int) -> list[Any]:
    """Each call's result, or the exception it raised (an SDK gives up after its retries)."""
    done: list[Any] = []

    def run(t: int) -> None:
        for i in range(each):
            try:
                done.append(call(t * each + i))
            except Exception as exc:
                done.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    return done


def _openai(base: str, http_client: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", http_client=http_client)


def _anthropic(base: str, http_client: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="sk-test", http_client=http_client)


def _chat(client: openai.OpenAI, i: int) -> str:
    reply = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": f"call {i} " + "x" * 40}])
    return str(reply.choices[0].message.content)


def _message(client: anthropic.Anthropic, i: int) -> str:
    reply = client.messages.create(model="mock", max_tokens=16,
                                   messages=[{"role": "user", "content": f"call {i}"}])
    return str(reply.content[0].text)  # type: ignore[union-attr]


def _check_no_quota_429(provider: mock.MockProvider, done: list[Any], calls: int) -> None:
    holds = len(provider.refusals) - provider.quota_refusals()
    print(f"\n{calls} calls: {len(provider.accepted)} accepted, {holds} refused in the hold, "
          f"{provider.quota_refusals()} for the quota; worst 1 s window "
          f"{max_in_window(provider.accepted, 1.0)} of {QUOTA}")
    assert [d for d in done if isinstance(d, BaseException)] == []
    assert len(done) == calls
    assert holds >= 1  # the hold was felt: the SDK retried
    assert provider.quota_refusals() == 0
    assert max_in_window(provider.accepted, 1.0) <= QUOTA


def test_openai_sdk_retries_wait_for_their_start(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """40 chat completions from 8 threads through one OpenAI client (default retries) at 9/s
    under a quota of 10/s, the provider refusing everything for 0.6 s mid-run: every call
    succeeds, and no request is refused for the quota."""
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        client = _openai(provider.url, gated_client(RATE, name="oai", gate=gate))
        timer = _hold_after(provider, 1.0)
        done = _in_threads(lambda i: _chat(client, i), threads=8, each=5)
        timer.join()
        client.close()
    _check_no_quota_429(provider, done, 40)


def test_anthropic_sdk_retries_wait_for_their_start(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """24 messages from 6 threads through one Anthropic client: the same."""
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        client = _anthropic(provider.url, gated_client(RATE, name="claude", gate=gate))
        timer = _hold_after(provider, 1.0)
        done = _in_threads(lambda i: _message(client, i), threads=6, each=4)
        timer.join()
        client.close()
    _check_no_quota_429(provider, done, 24)


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_async_sdks_wait_for_their_start(
        provider: mock.MockProvider, redis_url: str, prefix: str, sdk: str) -> None:
    """30 concurrent calls of AsyncOpenAI / AsyncAnthropic through async_gated_client: the
    same, with the gate made for the client's event loop."""

    async def main() -> list[str]:
        http = async_gated_client(RATE, name=f"async-{sdk}", url=redis_url, prefix=prefix)
        transport = http._transport
        assert isinstance(transport, AsyncGatedTransport)
        timer = _hold_after(provider, 1.0)
        try:
            if sdk == "openai":
                oai = openai.AsyncOpenAI(base_url=f"{provider.url}/v1", api_key="sk-test",
                                         http_client=http)
                replies: list[str] = []
                for reply in await asyncio.gather(*(oai.chat.completions.create(
                        model="mock", messages=[{"role": "user", "content": f"call {i}"}])
                        for i in range(30))):
                    replies.append(str(reply.choices[0].message.content))
            else:
                claude = anthropic.AsyncAnthropic(base_url=provider.url, api_key="sk-test",
                                                  http_client=http)
                replies = [str(r.content[0].text) for r in await asyncio.gather(  # type: ignore[union-attr]
                    *(claude.messages.create(model="mock", max_tokens=16, messages=[
                        {"role": "user", "content": f"call {i}"}]) for i in range(30)))]
            return replies
        finally:
            await http.aclose()
            timer.join()

    done = asyncio.run(main())
    _check_no_quota_429(provider, done, 30)


def test_wrapping_the_call_lets_the_sdk_retries_past_the_gate(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """Negative control: Gate.wait before each SDK call (a plain client) admits 40 calls, but
    the provider sees more requests than that: the SDK's retries after the hold went
    through no gate (and a call may fail once its retries are spent)."""
    limits = [Limit("wrapped", parse_rate(RATE))]
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        client = _openai(provider.url, httpx2.Client())

        def call(i: int) -> str:
            gate.wait(limits, timeout=60)
            return _chat(client, i)

        timer = _hold_after(provider, 1.0)
        done = _in_threads(call, threads=8, each=5)
        timer.join()
        client.close()
    sent = len(provider.accepted) + len(provider.refused)
    failed = [d for d in done if isinstance(d, openai.RateLimitError)]
    print(f"\n40 admitted by the gate, {sent} requests sent; {provider.quota_refusals()} "
          f"refused for the quota; {len(failed)} calls failed after the SDK's retries")
    assert len(done) == 40
    assert sent > 40


def test_a_429_pauses_the_limit_for_the_provider_s_retry_after(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """One refused request pauses the transport's limit for the retry-after-ms the provider
    sent (read back from the gate), and the 429 reaches the caller unchanged."""
    limit = Limit("paused", parse_rate("100/s"))
    with Gate.from_url(redis_url, prefix=prefix) as gate, httpx2.Client(
            transport=GatedTransport([limit], gate=gate)) as http:
        provider.hold(2.0)
        reply = http.post(f"{provider.url}/v1/chat/completions", json={"messages": []})
        assert reply.status_code == 429
        sent = int(reply.headers["retry-after-ms"]) / 1000
        paused = gate.inspect(limit).paused
    assert sent - 0.1 <= paused <= sent


def test_an_overloaded_provider_is_held_off_without_pausing_the_quota(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """The provider answers 529 (anthropic's OverloadedError) for 3 s, then serves: 10
    calls one after another, with the SDK's default retries, all succeed; its retries
    wait in the transport for the hold-off (1 s, then 2 s), so at most 3 requests meet
    the overload; the limit is never paused (Gate.inspect, read all along)."""
    limit = Limit("busy", parse_rate("100/s"))
    paused: list[float] = []
    done = threading.Event()
    with Gate.from_url(redis_url, prefix=prefix) as gate, httpx2.Client(
            transport=GatedTransport([limit], gate=gate)) as http:

        def watch() -> None:
            while not done.wait(0.05):
                paused.append(gate.inspect(limit).paused)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            client = _anthropic(provider.url, http)
            provider.answer_with("overloaded", seconds=3.0)
            started = time.monotonic()
            replies = [_message(client, i) for i in range(10)]
        finally:
            done.set()
            watcher.join(5)
    print(f"\n10 calls in {time.monotonic() - started:.2f} s; {len(provider.refusals)} "
          f"overloaded answers; {len(paused)} reads of the pause, the most {max(paused)}")
    assert len(replies) == 10
    assert 1 <= len(provider.refusals) <= 3
    assert len(paused) > 10
    assert max(paused) == 0


def _stopped_error(exc: BaseException) -> LimitStopped | None:
    """The LimitStopped an SDK's error carries (itself, or as the cause of its connection
    error)."""
    while exc is not None and not isinstance(exc, LimitStopped):
        exc = exc.__cause__  # type: ignore[assignment]
    return exc


@pytest.mark.parametrize(("sdk", "answer"), [
    ("openai", "insufficient_quota"), ("anthropic", "spend_cap"),
    ("anthropic", "usage_limit")])
def test_money_spent_stops_the_limit_for_every_caller_until_resumed(
        provider: mock.MockProvider, redis_url: str, prefix: str, sdk: str,
        answer: str) -> None:
    """The first answer that says the money is spent stops the limit: the call and every
    later one raise LimitStopped (the SDK's connection error carries it) at once, without a
    request, the SDK's own retries included; status shows the stop and the provider's
    words for a limit no task declares, and a resume sends again."""
    name = f"money-{sdk}-{answer}"
    provider.answer_with(answer, seconds=60)
    with gated_client("100/s", name=name, url=redis_url, prefix=prefix) as http:
        client: Any = (_openai(provider.url, http) if sdk == "openai"
                       else _anthropic(provider.url, http))
        call = _chat if sdk == "openai" else _message
        # (anthropic's client wraps it in its connection error and retries that, failing
        # here each time: about 1.3 s a call, so fewer calls)
        for i in range(20 if sdk == "openai" else 5):
            started = time.monotonic()
            with pytest.raises(Exception) as caught:  # noqa: PT011 (the SDK's own, or ours)
                call(client, i)
            assert time.monotonic() - started < 2.0
            stopped = _stopped_error(caught.value)
            assert stopped is not None, caught.value
            assert stopped.limit_name == name
            assert stopped.reason == "money"
        assert len(provider.refusals) == 1  # (one request reached it: the first)
        provider.answer_with(None)
        with installed_app("stopped", redis_url, prefix) as app:
            (row,) = [r for r in report.status(app)["limits"] if r["limit"] == name]
            assert row["paused_by"] == "money"
            assert row["stopped"]["message"] in str(mock.ANSWERS[answer][""][1])
            (asked,) = report.status(app, [name])["limits"]  # (asked by its name)
            assert (asked["limit"], asked["stopped"]) == (name, row["stopped"])
            assert control.resume(app, name)
            assert not [r for r in report.status(app)["limits"] if r["limit"] == name]
            with pytest.raises(report.UnknownLimit, match=name):  # (no longer stopped)
                report.status(app, [name])
        assert call(client, 99)
        assert len(provider.accepted) == 1


def test_an_async_client_stops_on_money_as_the_sync_one_does(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """AsyncAnthropic through async_gated_client against a spend cap: LimitStopped (carried by
    the SDK's connection error, whose retries fail here too), then again without a
    request; the stop is the same record a sync caller reads."""
    provider.answer_with("spend_cap", seconds=60)

    async def main() -> list[BaseException]:
        http = async_gated_client("100/s", name="async-money", url=redis_url, prefix=prefix)
        claude = anthropic.AsyncAnthropic(base_url=provider.url, api_key="sk-test",
                                          http_client=http)
        raised: list[BaseException] = []
        try:
            for i in range(3):
                try:
                    await claude.messages.create(model="mock", max_tokens=16, messages=[
                        {"role": "user", "content": f"call {i}"}])
                except (LimitStopped, anthropic.APIConnectionError) as exc:
                    raised.append(exc)  # (the async SDK wraps it in its connection error)
        finally:
            await http.aclose()
        return raised

    raised = asyncio.run(main())
    assert len(raised) == 3
    assert all(isinstance(_stopped_error(exc), LimitStopped) for exc in raised)
    assert len(provider.refusals) == 1
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        stop = gate.stopped([Limit("async-money", parse_rate("100/s"))])
        assert stop is not None
        assert "usage limit" in stop.message


def test_check_response_stops_on_money_and_reads_a_stop_an_sdk_wrapped(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """In a task: an answer that says the money is spent raises RateLimited with ``stop``
    (its limits stop, the task waits for the resume); so does the SDK's connection error
    whose cause is a gated client's LimitStopped."""
    provider.answer_with("insufficient_quota", count=1)
    client = _openai(provider.url, None).with_options(max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        _chat(client, 0)
    with pytest.raises(RateLimited) as limited:
        check_response(caught.value)
    assert limited.value.stop is not None
    assert "exceeded your current quota" in limited.value.stop
    wrapped = openai.APIConnectionError(request=httpx2.Request("POST", provider.url))
    wrapped.__cause__ = LimitStopped.of("openai", "money", "spent")
    with pytest.raises(RateLimited) as limited:
        check_response(wrapped)
    assert limited.value.stop == "spent"


def test_a_task_s_admission_is_its_first_request_s_start(redis_url: str, prefix: str) -> None:
    """Under an admission granted for the same bucket, the first request spends it (the
    bucket is charged nothing more); the second is charged; an admission too old is given
    back and a fresh start is charged instead (one start in all, not two)."""
    limit = Limit("credit", parse_rate("10/h"), burst=10)
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        return httpx.Response(200)

    with Gate.from_url(redis_url, prefix=prefix) as gate, httpx.Client(
            transport=GatedTransport([limit], gate=gate, transport=httpx.MockTransport(
                handler))) as http:
        gate.acquire_many([limit])  # the task's admission
        token = credit.grant({gate.key_of(limit): credit.Admission(limit, time.monotonic())})
        try:
            http.get("http://127.0.0.1/first")
            assert round(gate.inspect(limit).used) == 1
            http.get("http://127.0.0.1/second")
            assert round(gate.inspect(limit).used) == 2
        finally:
            credit.revoke(token)
        gate.acquire_many([limit])  # another run's admission, spent 1 s late
        token = credit.grant({gate.key_of(limit): credit.Admission(limit, time.monotonic() - 1)})
        try:
            http.get("http://127.0.0.1/late")
            assert round(gate.inspect(limit).used) == 3
        finally:
            credit.revoke(token)
    assert len(sent) == 3


def test_a_task_let_go_late_in_its_start_s_grace_has_less_admission_to_spend(
        app: Celery) -> None:
    """A task booked at 2/s and run 0.1 s after its booked start is admitted (its grace is 0.25 s),
    but its admission counts from the booked start: a request sent now would leave more than the
    transport's window (50 ms) after the start it stands for, so it waits for its own."""
    published: list[dict[str, Any]] = []
    seen: list[credit.Admission] = []

    @throttled("2/s", name="late-credit")
    @app.task(bind=True, shared=False, name="late_credit")
    def job(self: Task[Any, Any]) -> None:
        unspent = credit._unspent.get()
        assert unspent is not None
        seen.extend(unspent.values())

    job.signature_from_request = (  # type: ignore[method-assign]
        lambda request, **options: PublishRecorder(published, options))  # type: ignore[assignment]

    def run(headers: dict[str, Any] | None) -> None:
        job.push_request(id="t", called_directly=False, delivery_info={}, headers=headers)
        try:
            job.run()
        finally:
            job.pop_request()

    app.conf.throttle_max_sleep = 0  # the wait re-published with a countdown: recorded
    app.conf.throttle_waiting_room = False
    forget(app)
    run(None)  # admitted at once: its admission is fresh
    assert seen[-1].fresh(0.05)
    with pytest.raises(Ignore):
        run(None)  # booked 0.5 s after the first start
    (copy,) = published
    # (the countdown aims the dispatch lead before the booked start)
    time.sleep(copy["countdown"] + DISPATCH_LEAD + 0.1)
    run(copy["headers"])
    assert len(seen) == 2
    assert time.monotonic() - seen[-1].at >= 0.1
    assert not seen[-1].fresh(0.05)


def test_an_admission_of_another_bucket_is_not_spent(redis_url: str, prefix: str) -> None:
    """An admission for another limit (or another key value of it) leaves the request to
    be charged."""
    limit = Limit("mine", parse_rate("10/h"), burst=10, key="a")
    other = Limit("mine", parse_rate("10/h"), burst=10, key="b")
    with Gate.from_url(redis_url, prefix=prefix) as gate, httpx.Client(
            transport=GatedTransport([limit], gate=gate, transport=httpx.MockTransport(
                lambda request: httpx.Response(200)))) as http:
        token = credit.grant({gate.key_of(other): credit.Admission(other, time.monotonic())})
        try:
            http.get("http://127.0.0.1/")
        finally:
            credit.revoke(token)
        assert round(gate.inspect(limit).used) == 1


def test_bad_arguments_name_the_value(redis_url: str) -> None:
    """A rate without a name, a concurrency limit, an unknown HTTP package: clear errors."""
    from celery_throttle import Concurrency

    with pytest.raises(ValueError, match="name="):
        gated_client("5/s", url=redis_url)
    with pytest.raises(ValueError, match="url"):
        gated_client("5/s", name="x")
    with pytest.raises(TypeError, match="rate limits only"):
        gated_client(limits=[Concurrency("x", 2)], url=redis_url)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="'requests'"):
        gated_client("5/s", name="x", url=redis_url, module="requests")
    with pytest.raises(ValueError, match="gate"):
        AsyncGatedTransport([Limit("x", parse_rate("1/s"))])


def _share(follow: bool, redis_url: str, prefix: str) -> dict[str, float]:
    """48 calls from 6 threads (OpenAI SDK, gated client at 9/s) beside a consumer the gate
    cannot see spending 5/s of the same quota (a token bucket of 10 refilled at 10/s, as the
    providers keep it); what each got and was refused while the calls ran, and the share of
    what the other consumer left that ours used."""
    provider = mock.MockProvider(limit=QUOTA, window=1.0, latency=0.02, bucket=True).start()
    stop = threading.Event()

    def other() -> None:
        for _ in range(600):  # bounded: 5 per second for at most 2 minutes
            if stop.wait(0.2):
                return
            with contextlib.suppress(mock.RateLimited):
                mock.summarize(provider.url, "the other service")

    try:
        with Gate.from_url(redis_url, prefix=prefix) as gate:
            client = _openai(provider.url, gated_client(RATE, name="shared", gate=gate,
                                                        follow=follow))
            spender = threading.Thread(target=other)
            spender.start()
            time.sleep(1.0)  # the other consumer alone first: its pace is in the bucket
            began, wasted = time.time(), provider.wasted()
            done = _in_threads(lambda i: _chat(client, i), threads=6, each=8)
            ended, wasted = time.time(), provider.wasted() - wasted
            stop.set()
            spender.join(10)
            client.close()
    finally:
        provider.stop()
    span = ended - began
    seen = [(path, ok) for t, path, ok in provider.log if began <= t <= ended]
    ours = [ok for path, ok in seen if path == "/v1/chat/completions"]
    theirs = [ok for path, ok in seen if path == "/v1/summarize"]
    # What the other consumer left: ours, and what nobody took (the refill past a full
    # bucket).  What the bucket held at the start and at the end (at most 10 each) is
    # left out; the rate left, 10/s less theirs, is printed beside it.
    return {"failed": sum(1 for d in done if isinstance(d, BaseException)),
            "ours_refused": len(ours) - sum(ours), "theirs_refused": len(theirs) - sum(theirs),
            "used": round(sum(ours) / (sum(ours) + wasted), 3),
            "per_s_of_rate_left": round(sum(ours) / (QUOTA * span - sum(theirs)), 3),
            "span": round(span, 2)}


def test_a_consumer_the_gate_cannot_see_is_followed_from_the_headers(
        redis_url: str, prefix: str) -> None:
    """Another service spends half the provider's quota outside the gate.  Reading the
    answers' x-ratelimit-remaining/-reset headers, the gated calls are refused 0 times,
    refuse the other service nothing either, and use at least 0.9 of what it leaves."""
    got = _share(True, redis_url, prefix)
    print(f"\nfollowed: {got}")
    assert got["failed"] == 0
    assert got["ours_refused"] == 0
    assert got["theirs_refused"] == 0
    assert got["used"] >= 0.9


def test_without_the_headers_the_hidden_consumer_s_share_is_refused(
        redis_url: str, prefix: str) -> None:
    """Negative control: the same run with follow=False spends the limit's own 9/s, and
    the provider refuses the difference to one side or the other."""
    got = _share(False, redis_url, prefix)
    print(f"\nnot followed: {got}")
    assert got["ours_refused"] + got["theirs_refused"] >= 5


def _answering(status: int, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body,
                                                              headers=headers or {}))


def test_tokens_are_charged_the_estimate_then_settled_from_usage(
        redis_url: str, prefix: str) -> None:
    """A request of 80 prompt characters and max_tokens 10 is charged 20 + 10 tokens before
    it is sent; the answer's usage (7) is what the bucket keeps.  A 429's tokens were
    never spent: given back, and the limits paused."""
    tokens = Limit("tok", parse_rate("1000/h"), burst=1000)
    request = {"model": "m", "max_tokens": 10, "messages": [{"role": "user",
                                                             "content": "x" * 80}]}
    seen: list[float] = []
    with Gate.from_url(redis_url, prefix=prefix) as gate:

        def during(request: httpx.Request) -> httpx.Response:
            seen.append(gate.inspect(tokens).used)
            return httpx.Response(200, json={"usage": {"total_tokens": 7}})

        transport = GatedTransport([Limit("req", parse_rate("100/s"), burst=10)], gate=gate,
                                   tokens=tokens, transport=httpx.MockTransport(during))
        with httpx.Client(transport=transport) as http:
            http.post("http://127.0.0.1/v1/chat/completions", json=request)
        assert [round(u) for u in seen] == [30]
        assert round(gate.inspect(tokens).used) == 7
        refused = GatedTransport([Limit("req", parse_rate("100/s"), burst=10)], gate=gate,
                                 tokens=tokens, transport=_answering(
                                     429, {"error": {}}, {"retry-after-ms": "2000"}))
        with httpx.Client(transport=refused) as http:
            http.post("http://127.0.0.1/v1/chat/completions", json=request)
        assert round(gate.inspect(tokens).used) == 7
        assert gate.inspect(tokens).paused > 1.5


def test_separate_input_and_output_quotas_are_charged_and_settled_apart(
        redis_url: str, prefix: str) -> None:
    """Anthropic's two token quotas: the input limit is charged the prompt's 20, the output
    limit the answer's cap of 10; each keeps what usage says of its own part (input 20 + 3
    read from the cache, output 5)."""
    parts = {"in": Limit("in", parse_rate("1000/h"), burst=1000),
             "out": Limit("out", parse_rate("1000/h"), burst=1000)}
    seen: list[tuple[int, int]] = []
    with Gate.from_url(redis_url, prefix=prefix) as gate:

        def during(request: httpx.Request) -> httpx.Response:
            seen.append((round(gate.inspect(parts["in"]).used),
                         round(gate.inspect(parts["out"]).used)))
            return httpx.Response(200, json={"usage": {
                "input_tokens": 20, "cache_read_input_tokens": 3, "output_tokens": 5}})

        transport = GatedTransport([Limit("req", parse_rate("100/s"), burst=10)], gate=gate,
                                   input_tokens=parts["in"], output_tokens=parts["out"],
                                   transport=httpx.MockTransport(during))
        with httpx.Client(transport=transport) as http:
            http.post("http://127.0.0.1/v1/messages", json={
                "model": "m", "max_tokens": 10, "messages": [{"role": "user",
                                                              "content": "z" * 80}]})
        assert seen == [(20, 10)]
        assert (round(gate.inspect(parts["in"]).used),
                round(gate.inspect(parts["out"]).used)) == (23, 5)


def _token_run(tokens: str | None, redis_url: str, prefix: str) -> dict[str, Any]:
    """12 chat completions of about 40 prompt tokens (max_tokens 20) from 6 threads, against
    a provider allowing 300 tokens in any 2 s (requests are not the limit)."""
    provider = mock.MockProvider(limit=100, window=1.0, latency=0.02, token_budget=300,
                                 token_window=2.0).start()
    try:
        with Gate.from_url(redis_url, prefix=prefix) as gate:
            quota = None if tokens is None else Limit("tokq-tokens", parse_rate(tokens),
                                                      burst=100)
            client = _openai(provider.url, gated_client("50/s", name="tokq", tokens=quota,
                                                        gate=gate))

            def call(i: int) -> str:
                reply = client.chat.completions.create(
                    model="mock", max_tokens=20,
                    messages=[{"role": "user", "content": f"{i:03d} " + "y" * 156}])
                return str(reply.choices[0].message.content)

            done = _in_threads(call, threads=6, each=2)
            client.close()
    finally:
        provider.stop()
    spent = sorted(provider.calls)
    span = spent[-1][0] - spent[0][0] if len(spent) > 1 else 0.0
    return {"failed": sum(1 for d in done if isinstance(d, BaseException)),
            "refused": len(provider.refusals), "span": round(span, 2),
            "tokens": sum(n for _, _, n in spent)}


def test_a_token_quota_is_kept_with_estimates_settled(redis_url: str, prefix: str) -> None:
    """tokens="100/s" (burst 100: at most 300 in any 2 s) charged 60 per call (40 + 20),
    settled to the 40 the provider counts: 0 refused; without the token limit the same
    calls are refused for tokens."""
    got = _token_run("100/s", redis_url, f"{prefix}-a")
    bare = _token_run(None, redis_url, f"{prefix}-b")
    print(f"\nwith tokens=: {got}; without: {bare}")
    assert got["failed"] == 0
    assert got["refused"] == 0
    assert bare["refused"] >= 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_live_rate_applies_to_both_transports(redis_url: str, prefix: str, kind: str) -> None:
    """`celery throttle set live 1/h` over the code's 100/s: the second request would wait an
    hour, so it times out (booking nothing) in the sync and the async transport alike."""
    from celery_throttle import AsyncGate, ThrottleTimeout
    from celery_throttle.core.live import LiveLimits

    limits = [Limit("live", parse_rate("100/s"))]
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        LiveLimits(gate.client, prefix).set("live", "1/h")

        def ok(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200)

        if kind == "sync":
            with httpx.Client(transport=GatedTransport(
                    limits, gate=gate, timeout=0.5, transport=httpx.MockTransport(ok))) as http:
                assert http.get("http://127.0.0.1/").status_code == 200
                with pytest.raises(ThrottleTimeout, match="'live'"):
                    http.get("http://127.0.0.1/")
            return

    async def main() -> None:
        agate = AsyncGate.from_url(redis_url, prefix=prefix)
        transport = AsyncGatedTransport(limits, gate=agate, timeout=0.5,
                                        transport=httpx.MockTransport(ok))
        async with httpx.AsyncClient(transport=transport) as http:
            assert (await http.get("http://127.0.0.1/")).status_code == 200
            with pytest.raises(ThrottleTimeout, match="'live'"):
                await http.get("http://127.0.0.1/")
        await agate.aclose()

    asyncio.run(main())
