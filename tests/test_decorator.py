"""@throttled and install(): validation at definition time, settings, and the call-path hook."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task
from celery.exceptions import Ignore

import celery_throttle
from celery_throttle import Concurrency, Limit, ThrottleConfigError, throttled
from celery_throttle.config import read_config
from celery_throttle.task import specs_of
from celery_throttle.wait_state import HEADER, WaitState

from .workers import PublishRecorder


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    """A fresh app whose broker and throttle store are the test server (never started)."""
    a = Celery("unit", broker=f"{redis_url}/14", set_as_current=False)
    yield a
    a.close()


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


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("throttle_queues", {"llm": "bogus"}, r"throttle_queues\['llm'\]: invalid rate 'bogus'"),
        ("throttle_queues", {"llm": {"rate": "1/s", "brust": 2}}, r"throttle_queues\['llm'\]"),
        ("throttle_queues", ["llm"], "expected a dict"),
        ("throttle_on_error", "ignore", "throttle_on_error='ignore'"),
        ("throttle_max_wait", "10", "throttle_max_wait='10'"),
        ("throttle_prefix", "{x}", "throttle_prefix"),
        ("throttle_redis_url", "amqp://guest@localhost//", "redis://, rediss:// or unix://"),
        ("throttle_queus", {}, "unknown setting 'throttle_queus'; did you mean 'throttle_queues'"),
    ],
)
def test_bad_settings_fail_at_install(
    app: Celery, setting: str, value: object, message: str
) -> None:
    """install() raises ThrottleConfigError naming the bad or unknown setting."""
    app.conf[setting] = value
    with pytest.raises(ThrottleConfigError, match=message):
        celery_throttle.install(app)


def test_config_defaults(app: Celery) -> None:
    """Defaults: broker URL as store, 'defer', half the visibility timeout as max countdown."""
    app.conf.broker_transport_options = {"visibility_timeout": 600}
    config = read_config(app)
    assert config.redis_url == app.conf.broker_url
    assert config.on_error == "defer"
    assert config.max_countdown == 300.0
    assert "redis://" not in repr(config)  # the URL (and any password) stays out of reprs


def test_wait_state_ignores_malformed_headers() -> None:
    """A malformed or hostile header reads as 'no state', never crashes the task."""

    class Req:
        def __init__(self) -> None:
            self.headers = {HEADER: {"slot": "x", "deferrals": -3, "since": 1.5, "booked": None}}

    assert WaitState.from_request(Req()) == WaitState()


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
    from celery_throttle.store import forget

    def run_with(policy: str) -> Any:
        app.conf.throttle_on_error = policy
        forget(app)
        job.push_request(id="t-1", called_directly=False, delivery_info={}, headers=None)
        try:
            return job.run()
        finally:
            job.pop_request()

    import celery_throttle.defer as defer_module

    defer_module._last_outage_log = 0.0
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
