"""What Celery's own tools show of a waiting task: THROTTLED, in the result backend and in
the task events Flower reads, until it runs."""

from __future__ import annotations

import threading
import time
from types import ModuleType
from typing import Any

import pytest
import redis

from ..workers import wait_results, worker_nodes

pytestmark = pytest.mark.integration


def test_a_parked_task_is_throttled_in_the_backend_and_the_event_state(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Six tasks at 1/s: the last waits about 5 s, parked.  Meanwhile its result says
    THROTTLED (with the limit and its expected start) and Celery's event state, as Flower
    keeps it, says THROTTLED; once it has run, both say SUCCESS."""
    app = capp.app
    state = app.events.State()
    types: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        types.append(event["type"])
        state.event(event)

    with app.connection_for_read() as conn, \
            worker_nodes(redis_base, ("w1",), conf={"worker_send_task_events": True}):
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": 10_000},
                                     daemon=True)
        listening.start()
        try:
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
            time.sleep(1.5)  # the last events' trip
        finally:
            receiver.should_stop = True
            listening.join(5)
    assert backend_state == "THROTTLED"
    assert (meta["limit"], meta["reason"], meta["deferrals"]) == ("patient", "limit", 1)
    assert "T" in meta["eta"]  # ISO 8601, UTC
    assert event_state == "THROTTLED"
    assert "task-throttled" in types
    assert last.state == "SUCCESS"
    assert state.tasks[last.id].state == "SUCCESS"
