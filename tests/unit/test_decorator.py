"""@throttled (task.py): validation at definition time, and the call-path hook."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from celery import Celery, Task
from celery.exceptions import Ignore

import celery_throttle
from celery_throttle import Concurrency, Limit, throttled
from celery_throttle.integration.throttled import specs_of
from celery_throttle.room.header import HEADER

from ..workers import PublishRecorder


def test_bad_rate_names_task_and_value(app: Celery) -> None:
    """A bad rate fails at import, naming the task and the value."""
    with pytest.raises(ValueError, match=r"@throttled on task '[\w.]*job': invalid rate 'ten/s'"):
        @throttled("ten/s")
        @app.task(shared=False)
        def job() -> None: ...


def test_key_must_be_an_argument(app: Celery) -> None:
    """A key naming no argument of the task fails at import, listing the arguments."""
    with pytest.raises(ValueError, match=r"key 'tenant' is not an argument .*\(arguments: doc\)"):
        @throttled("5/s", key="tenant")
        @app.task(bind=True, shared=False)
        def job(self: Task[Any, Any], doc: str) -> None: ...


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"burst": 0}, "invalid burst 0"),
        ({"cost": 0}, "invalid cost 0"),
        ({"cost": 5, "burst": 2}, "cost 5 exceeds burst 2"),
        ({"key": 3}, "invalid key 3"),
        ({"fair": 3}, "invalid fair 3"),
        ({"name": ""}, "invalid limit name ''"),
        ({"max_wait": -1}, "invalid max_wait -1"),
        ({"concurrency": 0}, "invalid concurrency 0"),
        ({"concurrency": "3"}, "invalid concurrency '3'"),
        ({"concurrency": 2, "lease": 0}, "invalid lease 0"),
    ],
)
def test_bad_arguments_rejected_at_import(
    app: Celery, kwargs: dict[str, Any], message: str
) -> None:
    """Each bad decorator argument is a ValueError naming the value."""
    with pytest.raises(ValueError, match=message):
        @throttled("1/s", **kwargs)
        @app.task(shared=False)
        def job(a: int) -> None: ...


def test_concurrency_alone_or_with_a_rate(app: Celery) -> None:
    """`concurrency=` works without a rate; with one, both limits share the name."""

    @throttled(concurrency=2, lease=10, key="tenant")
    @throttled("5/s", concurrency=3, name="llm")
    @app.task(shared=False)
    def job(tenant: str) -> None: ...

    inner, outer = specs_of(app.tasks[job.name])
    assert [type(lim).__name__ for lim in inner.limits(job.name, ("acme",), {})] == [
        "Limit", "Concurrency"]
    (alone,) = outer.limits(job.name, ("acme",), {})
    assert alone == Concurrency(job.name, 2, "acme", 10)
    with pytest.raises(ValueError, match="give a rate, a concurrency, or both"):
        @throttled()
        @app.task(shared=False)
        def nothing() -> None: ...


def test_throttled_below_app_task_is_refused() -> None:
    """@throttled applied to a plain function (below @app.task) says where it belongs."""
    with pytest.raises(TypeError, match=r"above @app\.task"):
        throttled("1/s")(lambda: None)


def test_stacked_specs_attach_to_the_task_when_evaluated(app: Celery) -> None:
    """Stacked decorators on a lazy task attach both limits once the task exists."""

    @throttled("10/s", name="openai")
    @throttled("90000/m", name="openai-tokens", burst=90000, cost=lambda prompt: len(prompt))
    @app.task(shared=False)
    def summarize(prompt: str) -> int:
        return len(prompt)

    names = [s.name for s in specs_of(app.tasks[summarize.name])]
    assert names == ["openai-tokens", "openai"]


def test_direct_and_eager_calls_bypass_the_gate(app: Celery) -> None:
    """Calling the task directly or with apply() runs it without any Redis call."""
    app.conf.throttle_redis_url = "redis://127.0.0.1:1/0"  # nothing listens there

    @throttled("1/h")
    @app.task(shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    assert add(1, 2) == 3
    assert add(1, 2) == 3
    assert add.apply((2, 3)).get() == 5


def test_store_down_policies(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """Store unreachable: 'allow' runs with a WARNING, 'fail' raises, 'defer' re-publishes."""
    app.conf.throttle_redis_url = "redis://:s3cret@127.0.0.1:1/0"  # nothing listens there
    celery_throttle.install(app)
    published: list[dict[str, Any]] = []

    @throttled("1/s")
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any]) -> str:
        return "ran"

    job.signature_from_request = lambda request, **options: PublishRecorder(published, options)  # type: ignore[method-assign,assignment]
    from celery_throttle.integration.runtime import forget

    def run_with(policy: str) -> Any:
        app.conf.throttle_on_error = policy
        forget(app)
        job.push_request(id="t-1", called_directly=False, delivery_info={}, headers=None)
        try:
            return job.run()
        finally:
            job.pop_request()

    with caplog.at_level(logging.DEBUG, logger="celery_throttle"):
        assert run_with("allow") == "ran"
        with pytest.raises(celery_throttle.ThrottleStoreError):
            run_with("fail")
        with pytest.raises(Ignore):
            run_with("defer")
    assert len(published) == 1
    assert published[0]["headers"][HEADER]["deferrals"] == 1
    assert 0.5 <= published[0]["countdown"] <= 1.0
    assert "store unavailable" in caplog.text
    assert "s3cret" not in caplog.text


def test_fair_value_from_an_argument_or_a_callable(app: Celery) -> None:
    """``fair`` names an argument (checked at import) or takes a callable; the value rides
    on the rate limit without changing its identity (bucket and decisions)."""
    with pytest.raises(ValueError, match=r"fair 'org' is not an argument"):
        @throttled("5/s", fair="org")
        @app.task(shared=False)
        def bad(tenant: str) -> None: ...
    with pytest.raises(ValueError, match="fair shares a rate"):
        @throttled(concurrency=2, fair="tenant")
        @app.task(shared=False)
        def seats(tenant: str) -> None: ...

    @throttled("5/s", name="shared", fair="tenant")
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any], tenant: str, doc: str) -> None: ...

    @throttled("5/s", name="shared", fair=lambda tenant, doc: tenant.upper())
    @app.task(shared=False)
    def other(tenant: str, doc: str) -> None: ...

    (limit,) = specs_of(app.tasks[job.name])[0].limits(job.name, ("acme", "x"), {})
    (upper,) = specs_of(app.tasks[other.name])[0].limits(other.name, (), {"tenant": "acme",
                                                                          "doc": "x"})
    assert isinstance(limit, Limit)
    assert isinstance(upper, Limit)
    assert (limit.fair, upper.fair) == ("acme", "ACME")
    assert limit == upper  # one bucket
    with pytest.raises(ValueError, match="fair argument 'tenant' was not passed"):
        specs_of(app.tasks[job.name])[0].limits(job.name, (), {"doc": "x"})


def test_key_and_cost_from_positional_or_keyword_arguments(app: Celery) -> None:
    """The key argument is found whether passed by position or by name; cost likewise."""

    @throttled("5/s", key="tenant", cost=lambda tenant, doc: len(doc), burst=10)
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any], tenant: str, doc: str) -> None: ...

    (spec,) = specs_of(app.tasks[job.name])
    (by_position,) = spec.limits(job.name, ("acme", "abc"), {})
    (by_name,) = spec.limits(job.name, (), {"doc": "abc", "tenant": "acme"})
    assert isinstance(by_position, Limit)
    assert (by_position.key, by_position.cost) == ("acme", 3)
    assert by_position == by_name
    with pytest.raises(ValueError, match="key argument 'tenant' is None"):
        spec.limits(job.name, (None, "abc"), {})
    with pytest.raises(ValueError, match="cost 11 exceeds burst 10 of limit"):
        spec.limits(job.name, ("acme", "x" * 11), {})
    with pytest.raises(TypeError, match="type float"):
        spec.limits(job.name, (1.5, "abc"), {})




def test_a_run_gives_its_lease_back_however_it_ends(app: Celery, prefix: str) -> None:
    """The gated run itself releases its concurrency lease as it ends: returned or raised
    (no task_postrun receiver needed, so an app that was never installed releases too)."""
    from celery_throttle import Concurrency, Gate

    app.conf.throttle_prefix = prefix
    held_inside: list[int] = []

    @throttled(concurrency=1, name="one-seat")
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any], fail: bool) -> str:
        gate = Gate.from_url(app.conf.broker_url, prefix=prefix)
        held_inside.append(gate.inspect_leases(Concurrency("one-seat", 1)).held)
        if fail:
            raise RuntimeError("boom")
        return "ran"

    gate = Gate.from_url(app.conf.broker_url, prefix=prefix)
    for n, fail in enumerate([False, True, False]):
        job.push_request(id=f"t-{n}", called_directly=False, delivery_info={}, headers=None)
        try:
            if fail:
                with pytest.raises(RuntimeError, match="boom"):
                    job.run(fail)
            else:
                assert job.run(fail) == "ran"
        finally:
            job.pop_request()
        assert gate.inspect_leases(Concurrency("one-seat", 1)).held == 0
    assert held_inside == [1, 1, 1]  # each run held the one booked start, and got it: none leaked


def test_a_copy_charged_for_its_turn_that_meets_the_store_down_comes_back_as_a_new_copy(
        app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy dispatched for its turn takes its entry as it arrives; if the store fails at its
    seat check (policy "defer"), the copy re-published to wait names no entry, so its next
    arrival is a new copy's, not a second copy of the entry it spent (dropped unrun)."""
    import redis

    from celery_throttle.integration.runtime import runtime_for

    celery_throttle.install(app)
    published: list[dict[str, Any]] = []

    @throttled(concurrency=1)
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any]) -> str:
        return "ran"

    job.signature_from_request = lambda request, **options: PublishRecorder(published, options)  # type: ignore[method-assign,assignment]

    def store_down(*_: Any, **__: Any) -> int:
        raise redis.ConnectionError("the store went away")

    monkeypatch.setattr(runtime_for(app).gate, "extend", store_down)
    header = {"entry": "t-turn:-", "token": "tok", "room": 1, "charged": "c", "deferrals": 2}
    job.push_request(id="t-turn", called_directly=False, delivery_info={},
                     headers={HEADER: header})
    try:
        with pytest.raises(Ignore):
            job.run()
    finally:
        job.pop_request()
    (copy,) = published
    sent = copy["headers"][HEADER]
    assert not sent.get("entry")
    assert not sent.get("charged")
    assert sent["deferrals"] == 3
