"""A limit that learns its rate, wired in: gated clients, tasks' refusals, status, metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from celery_throttle import Gate, Limit, RateLimited, check_response, parse_rate, throttled
from celery_throttle.core.limits import pauses_for_refusal
from celery_throttle.integration.exporter import FillCollector
from celery_throttle.integration.runtime import runtime_for
from celery_throttle.ops import report
from celery_throttle.ops.cli import _table
from celery_throttle.transport import gated_client
from examples import provider as mock

from ..conftest import installed_app


@pytest.fixture
def provider() -> Iterator[mock.MockProvider]:
    """A provider with no rate-limit headers (most SaaS APIs, proxies)."""
    server = mock.MockProvider(limit=100, window=1.0, latency=0.01, rate_headers=False).start()
    yield server
    server.stop()


def _get(client: httpx.Client, url: str) -> int:
    return client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}
                       ).status_code


def test_a_bare_429_cuts_a_gated_clients_learned_rate_and_pauses_nothing(
        provider: mock.MockProvider, redis_url: str, prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A 429 without a wait through gated_client(adaptive=True): the learned rate drops by
    15 % (said at INFO), the limit is not paused; status shows the learned rate for a
    limit no task declares, by its name too."""
    caplog.set_level(logging.INFO, logger="celery_throttle")
    provider.answer_with("bare", count=1)
    lim = Limit("saas", parse_rate("20/s"), adaptive=True)
    with gated_client("20/s", name="saas", url=redis_url, prefix=prefix, adaptive=True,
                      module="httpx") as http, Gate.from_url(redis_url, prefix=prefix) as gate:
        assert _get(http, provider.url) == 429
        state = gate.inspect(lim)
        assert state.paused == 0.0
        assert state.learned is not None
        assert state.learned.rate == pytest.approx(17.0, rel=1e-4)
        assert state.learned.why == "cut"
        assert _get(http, provider.url) == 200
    said = [r.getMessage() for r in caplog.records if "learned rate" in r.getMessage()]
    assert said == ["throttle: learned rate of saas cut from 20/s to 17/s (the provider "
                    "refused a request for its quota)"]
    with installed_app("learners", redis_url, prefix) as app:
        (row,) = report.status(app, ["saas"])["limits"]
        assert row["learned"]["rate_per_s"] == pytest.approx(17.0, rel=1e-4)
        assert row["learned"]["moved"] == "cut"
        assert row["used_by"] == ["(no task: a gated client's)"]
        assert "20/s, learned 17/s (cut " in _table([row])
        assert "paused" not in _table([row])
        gauges = {s.labels["limit"]: s.value for family in FillCollector(app).collect()
                  for s in family.samples if family.name == "celery_throttle_learned_rate"}
        assert gauges == {"saas": pytest.approx(17.0, rel=1e-4)}


def test_a_429_that_names_its_wait_pauses_and_cuts(provider: mock.MockProvider,
                                                   redis_url: str, prefix: str) -> None:
    """A 429 with Retry-After through an adaptive gated client: paused for that long, and
    cut as well."""
    provider.hold(1.0)  # (429 with Retry-After: the rest of the second)
    lim = Limit("named", parse_rate("20/s"), adaptive=True)
    with gated_client("20/s", name="named", url=redis_url, prefix=prefix, adaptive=True,
                      module="httpx") as http, Gate.from_url(redis_url, prefix=prefix) as gate:
        assert _get(http, provider.url) == 429
        state = gate.inspect(lim)
        assert state.paused > 0.5
        assert state.learned is not None
        assert state.learned.rate == pytest.approx(17.0, rel=1e-4)


def test_a_fixed_limit_beside_a_learning_one_still_pauses_on_a_bare_429() -> None:
    """A refusal that names no wait: the learning limits are cut and not paused, the fixed
    ones paused the default; a named wait pauses every one."""
    learning = Limit("a", parse_rate("5/s"), adaptive=True)
    fixed = Limit("b", parse_rate("5/s"))
    assert pauses_for_refusal([learning, fixed], 1.0, named=False) == [
        ([learning], 0.0), ([fixed], 1.0)]
    assert pauses_for_refusal([learning, fixed], 3.0, named=True) == [
        ([learning, fixed], 3.0)]
    assert pauses_for_refusal([fixed], 1.0, named=False) == [([fixed], 1.0)]


def test_a_refusal_says_whether_its_wait_was_named(provider: mock.MockProvider) -> None:
    """check_response's RateLimited: named from Retry-After, not from a bare 429; kept
    through a pickle (a result backend's copy)."""
    import pickle

    for kind, named in (("bare", False), ("held", True)):
        if kind == "bare":
            provider.answer_with(kind, count=1)
        else:
            provider.hold(1.0)
        response = httpx.post(f"{provider.url}/v1/chat/completions", json={})
        with pytest.raises(RateLimited) as caught:
            check_response(response)
        assert caught.value.named is named
        assert pickle.loads(pickle.dumps(caught.value)).named is named
    assert RateLimited().named is False
    assert RateLimited(2.0).named is True


def test_throttled_declares_a_limit_that_learns(redis_url: str, prefix: str) -> None:
    """@throttled(rate, adaptive=True, floor=...) makes its tasks' limit learn; status shows
    the learned rate beside the code's; a floor without a rate is refused by name."""
    with installed_app("adaptive", redis_url, prefix) as app:
        @throttled("30/s", name="learner", adaptive=True, floor="3/s")
        @app.task(name="learning_task")
        def learning_task() -> None:
            """A task under a limit that learns."""

        (limit,) = [k.limit for k in report.select(app, ["learner"])]
        assert isinstance(limit, Limit)
        assert (limit.adaptive, limit.floor) == (True, parse_rate("3/s"))
        runtime_for(app).gate.pause([limit], 0.0, refused_after=0.0)
        (row,) = report.status(app, ["learner"])["limits"]
        assert row["learned"]["rate_per_s"] == pytest.approx(25.5, rel=1e-4)
        assert row["used_by"] == ["learning_task"]
        with pytest.raises(ValueError, match="adaptive learns a rate"):
            @throttled(concurrency=2, adaptive=True)
            @app.task(shared=False)
            def seats() -> None: ...
        with pytest.raises(ValueError, match="invalid floor '6/s': above the rate 5/s"):
            @throttled("5/s", adaptive=True, floor="6/s")
            @app.task(shared=False)
            def floored() -> None: ...


def test_a_rate_set_under_the_floor_is_the_floor(redis_url: str, prefix: str) -> None:
    """throttle set below a learning limit's floor: decisions go on at the set rate."""
    from celery_throttle.core.live import LiveLimits

    with Gate.from_url(redis_url, prefix=prefix) as gate:
        live = LiveLimits(gate.client, prefix)
        live.set("floored", parse_rate("2/s"), 1)
        lim = Limit("floored", parse_rate("10/s"), adaptive=True, floor=parse_rate("5/s"))
        (applied,) = live.apply([lim])
        assert isinstance(applied, Limit)
        assert (applied.rate, applied.floor) == (parse_rate("2/s"), parse_rate("2/s"))
        assert gate.acquire_many([applied]).allowed
        assert gate.acquire_many([applied]).retry_after == pytest.approx(0.5, abs=0.01)
