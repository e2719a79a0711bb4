"""What Celery's own tools show of a waiting task: THROTTLED, in the result backend and in
the task events Flower reads, until it runs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from ..servers import until
from ..workers import read_records, wait_results, worker_nodes

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def listening(app: Any, redis_base: str) -> Iterator[tuple[Any, list[str]]]:
    """One worker node sending task events, and Celery's event state (what Flower keeps) fed
    by a real receiver meanwhile: (the state, the event types seen)."""
    state = app.events.State()
    types: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        types.append(event["type"])
        state.event(event)

    with app.connection_for_read() as conn, \
            worker_nodes(redis_base, ("w1",), conf={"worker_send_task_events": True}):
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": 10_000},
                                  daemon=True)
        thread.start()
        try:
            yield state, types
        finally:
            receiver.should_stop = True
            thread.join(5)


def test_a_parked_task_is_throttled_in_the_backend_and_the_event_state(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Six tasks at 1/s: the last waits about 5 s, parked.  Meanwhile its result says
    THROTTLED (with the limit and its expected start) and Celery's event state, as Flower
    keeps it, says THROTTLED; once it has run, both say SUCCESS."""
    with listening(capp.app, redis_base) as (state, types):
        results = [capp.patient.delay(i) for i in range(6)]
        last = results[-1]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and last.state != "THROTTLED":
            time.sleep(0.1)
        backend_state, meta = last.state, last.info
        event_state = None
        while time.monotonic() < deadline and event_state != "THROTTLED":
            time.sleep(0.1)
            seen = state.tasks.get(last.id)
            event_state = seen.state if seen is not None else None
        assert wait_results(results, timeout=30) == ["SUCCESS"] * 6
        until("the last task's events arrive",
              lambda: getattr(state.tasks.get(last.id), "state", None) == "SUCCESS", 10)
    assert backend_state == "THROTTLED"
    assert (meta["limit"], meta["reason"], meta["deferrals"]) == ("patient", "limit", 1)
    assert "T" in meta["eta"]  # ISO 8601, UTC
    assert event_state == "THROTTLED"
    assert "task-throttled" in types
    assert last.state == "SUCCESS"
    assert state.tasks[last.id].state == "SUCCESS"


def test_dropped_waiting_tasks_show_dropped_in_the_event_state(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Ten tasks at one per 2 s: the sixth revoked while it waits in line, then the rest
    purged.  Celery's event state (Flower's) shows each DROPPED with its reason, where it
    showed THROTTLED; the result backend says REVOKED.  (The five are due 10 s and more
    ahead: on a loaded machine the steps before the purge took more than 6 s.)"""
    from celery_throttle.integration.runtime import runtime_for
    from celery_throttle.ops import control

    app = capp.app

    def states(ids: list[str]) -> list[str | None]:
        return [getattr(state.tasks.get(i), "state", None) for i in ids]

    with listening(app, redis_base) as (state, _):
        results = [capp.long_wait.delay(i) for i in range(10)]
        waiting = [r.id for r in results[5:]]  # due 10 s and more from now
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and states(waiting) != ["THROTTLED"] * 5:
            time.sleep(0.1)
        throttled = states(waiting)
        app.control.revoke(waiting[0])
        runtime_for(app).room.lines.look_now("hops")  # passed on now
        while time.monotonic() < deadline and states(waiting[:1]) != ["DROPPED"]:
            time.sleep(0.1)
        purged = control.purge(app)
        while time.monotonic() < deadline and states(waiting) != ["DROPPED"] * 5:
            time.sleep(0.1)
        shown = states(waiting)
        reasons = [getattr(state.tasks.get(i), "reason", None) for i in waiting]
        wait_results(results, timeout=10)  # each started (and ended) or dropped
        started = {r["id"] for r in read_records(records, expect=0, timeout=0)}
    assert throttled == ["THROTTLED"] * 5
    assert shown == ["DROPPED"] * 5
    assert reasons == ["revoked", "purged", "purged", "purged", "purged"]
    # Every task neither started nor revoked was purged: the revoked one had left
    # the waiting room when the worker dropped it.
    assert waiting[0] not in started
    assert purged.dropped == 10 - 1 - len(started)
    assert [r.state for r in results[5:]] == ["REVOKED"] * 5
