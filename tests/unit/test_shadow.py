"""Shadow mode: limits decided and counted as usual, whose tasks never wait for them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task
from celery.exceptions import Ignore

from celery_throttle import Limit, metrics, parse_rate, throttled
from celery_throttle.integration.runtime import forget, runtime_for
from celery_throttle.ops import control, report

from ..conftest import installed_app
from ..workers import PublishRecorder


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    """An app on the test server with this test's own prefix (never started)."""
    metrics.reset()
    # (Without the waiting room a deferral is published, and recorded here.)
    with installed_app("shadow", redis_url, prefix, throttle_waiting_room=False) as a:
        yield a


def _run(job: Task[Any, Any], n: int, published: list[dict[str, Any]]) -> tuple[int, float]:
    """Call ``job`` ``n`` times as a worker would: (runs, seconds the calls took)."""
    job.signature_from_request = (  # type: ignore[method-assign]
        lambda request, **options: PublishRecorder(published, options))  # type: ignore[assignment]
    ran = 0
    started = time.monotonic()
    for i in range(n):
        job.push_request(id=f"task-{i}", called_directly=False, delivery_info={}, headers=None)
        try:
            job.run()
            ran += 1
        except Ignore:
            pass
        finally:
            job.pop_request()
    return ran, time.monotonic() - started


def _row(app: Celery, name: str) -> dict[str, Any]:
    runtime_for(app).counts.write()  # (a worker's writer does it within a second)
    return next(r for r in report.status(app, (name,))["limits"])


def test_a_shadowed_limit_runs_a_burst_at_once_and_counts_what_it_would_have_done(
        app: Celery) -> None:
    """5/s, burst 5, enforce=False, 100 tasks: all 100 run at once; 95 would have waited,
    the last about 19 s, and status says so (would-have deferrals and drain time)."""
    published: list[dict[str, Any]] = []

    @throttled("5/s", burst=5, name="trial", enforce=False)
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any]) -> None: ...

    started = time.monotonic()
    ran, took = _run(job, 100, published)
    assert (ran, published) == (100, [])
    assert took < 5  # (no task waited: 100 decisions, not 19 s of booked starts)
    counts = metrics.snapshot()["trial"]
    # The calls took `took` s, in which the bucket refilled took x 5 starts.
    assert 95 - 5 * took - 1 <= counts["would_defer"] <= 95
    assert counts["admitted"] == 100
    assert counts["deferred"] == 0
    row = _row(app, "trial")
    # What is booked ahead is read later than it was booked: the booked starts passed meanwhile
    # (5 a second) are behind the read (measured on a loaded machine: one of 95).
    since = time.monotonic() - started
    assert (row["enforced"], row["enforced_by"]) == (False, "code")
    assert row["shadow"]["would_defer_15m"] == counts["would_defer"]
    assert 19.2 - since - 0.5 <= row["shadow"]["would_next_free_s"] <= 19.2  # (95 x 0.2 s)
    assert counts["would_defer"] - 5 * since - 1 <= row["shadow"]["would_booked_ahead"] \
        <= counts["would_defer"]
    real = runtime_for(app).gate.inspect(Limit("trial", parse_rate("5/s"), 5))
    assert real.used == 0  # the real bucket was never charged


def test_the_app_setting_the_decorator_and_the_live_switch_in_that_order(app: Celery) -> None:
    """throttle_enforce=False shadows every limit; enforce=True on a limit overrides it;
    `shadow NAME off|on|unset` overrides both, and unset gives the choice back."""
    app.conf.throttle_enforce = False
    forget(app)
    published: list[dict[str, Any]] = []

    @throttled("1/s", name="app-wide")
    @app.task(bind=True, shared=False)
    def loose(self: Task[Any, Any]) -> None: ...

    @throttled("1/s", name="strict", enforce=True)
    @app.task(bind=True, shared=False)
    def strict(self: Task[Any, Any]) -> None: ...

    assert _run(loose, 3, published)[0] == 3  # app-wide shadow
    assert _run(strict, 3, published)[0] == 1  # its own enforce=True
    assert len(published) == 2
    rows = {r["limit"]: r for r in report.status(app)["limits"]}
    assert (rows["app-wide"]["enforced"], rows["app-wide"]["enforced_by"]) == (False, "app")
    assert (rows["strict"]["enforced"], rows["strict"]["enforced_by"]) == (True, "code")
    runtime = runtime_for(app)
    runtime.live.clock = lambda: time.monotonic() + 10  # (its copy is re-read now)
    control.shadow(app, "app-wide", "off")
    control.shadow(app, "strict", "on")
    runtime.live.clock = lambda: time.monotonic() + 20
    gate = runtime.gate
    for name in ("app-wide", "strict"):
        gate.reset(Limit(name, parse_rate("1/s")))
    published.clear()
    assert _run(loose, 3, published)[0] == 1  # enforced by the switch
    assert _run(strict, 3, published)[0] == 3  # shadowed by the switch
    rows = {r["limit"]: r for r in report.status(app)["limits"]}
    assert rows["strict"]["enforced_by"] == "live"
    assert control.shadow(app, "strict", "unset") == (None, True)
    runtime.live.clock = lambda: time.monotonic() + 30
    rows = {r["limit"]: r for r in report.status(app)["limits"]}
    assert (rows["strict"]["enforced"], rows["strict"]["enforced_by"]) == (True, "code")


def test_a_task_deferred_by_an_enforced_limit_is_not_counted_in_shadow(app: Celery) -> None:
    """Only a task that starts is decided in shadow: one deferred by its enforced limit
    comes back later and is decided then, once."""
    published: list[dict[str, Any]] = []

    # (A slow shadow limit: its one charge shows in the bucket for seconds, however long
    # the three deferrals take; at 100/s it had drained 10 ms later.)
    @throttled("10/m", burst=10, name="would", enforce=False)
    @throttled("1/s", name="real")
    @app.task(bind=True, shared=False)
    def both(self: Task[Any, Any]) -> None: ...

    assert _run(both, 4, published)[0] == 1
    assert len(published) == 3
    counts = metrics.snapshot()
    assert counts["would"]["admitted"] == 1
    assert counts["would"]["would_defer"] == 0
    assert runtime_for(app).shadow.inspect(Limit("would", parse_rate("10/m"), 10)).used > 0


def test_a_shadowed_concurrency_limit_holds_and_gives_back_its_shadow_seat(app: Celery) -> None:
    """concurrency=1 in shadow: a second run while the first holds the seat would have
    waited (counted) but runs; the seat is given back when the run ends."""
    published: list[dict[str, Any]] = []
    inner: list[int] = []

    @throttled(concurrency=1, name="one-at-a-time", enforce=False)
    @app.task(bind=True, shared=False)
    def seat(self: Task[Any, Any], depth: int) -> None:
        inner.append(depth)
        if depth == 0:  # a second run starts while this one holds the seat
            seat.push_request(id="inner", called_directly=False, delivery_info={},
                              headers=None)
            try:
                seat.run(1)
            finally:
                seat.pop_request()

    seat.push_request(id="outer", called_directly=False, delivery_info={}, headers=None)
    try:
        seat.run(0)
    finally:
        seat.pop_request()
    assert inner == [0, 1]
    assert published == []
    assert metrics.snapshot()["one-at-a-time"]["would_defer"] == 1
    from celery_throttle import Concurrency
    assert runtime_for(app).shadow.inspect_leases(Concurrency("one-at-a-time", 1)).held == 0


def test_bad_switches_are_refused(app: Celery) -> None:
    """An unknown limit or mode is an error naming it; nothing is written."""
    @throttled("1/s", name="known")
    @app.task(bind=True, shared=False)
    def known(self: Task[Any, Any]) -> None: ...

    with pytest.raises(report.UnknownLimit, match="'nope'"):
        control.shadow(app, "nope", "on")
    with pytest.raises(control.BadValue, match="'maybe'"):
        control.shadow(app, "known", "maybe")
    with pytest.raises(ValueError, match="enforce 'no'"):
        throttled("1/s", enforce="no")(known)  # type: ignore[arg-type]
    assert runtime_for(app).live.read_enforce() == {}
