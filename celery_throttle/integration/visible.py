"""What Celery's own tools show of a waiting task: the ``THROTTLED`` state.

A task that must wait ends its current run with Celery's ``Ignore``, which
Celery records nowhere: its result stays PENDING (or STARTED), and in Flower
it stays STARTED, exactly like a task that was lost.  So each deferral says
it, in Celery's own terms, without a round trip for a task that does not
wait:

* in the result backend, where the app has one and the task keeps results:
  the state ``THROTTLED``, its meta the limit, when the task expects to start
  (``eta``, ISO 8601 UTC), its deferral count and why it waits (one backend
  write per deferral; none while the throttle's store is down);
* as a task event ``task-throttled`` with the same fields, where the worker
  sends task events (``-E``, ``worker_send_task_events``).  Celery's event
  state, which Flower and ``celery events`` use, takes a custom event's type
  as the task's state and ranks it above STARTED and RECEIVED: the task shows
  THROTTLED until it succeeds or fails.

Both are best effort: the wait itself is what matters, and the task is
already parked or re-published when they are written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any

from celery import Task
from celery.backends.base import DisabledBackend

__all__ = ["THROTTLED", "announce"]

#: The state of a task that waits for its slot outside the worker.
THROTTLED = "THROTTLED"
#: The task event announcing it (Celery's event state shows it as THROTTLED).
EVENT = "task-throttled"


def announce(task: Task[Any, Any], *, limit: str, wait: float, deferrals: int,
             reason: str) -> None:
    """Record that ``task`` waits ``wait`` seconds for ``limit`` (``reason``: "limit", or
    "provider" for a 429's pause).  Not called while the throttle's store is down: a result
    backend on the same server would be down too, and Celery's Redis backend retries a
    write for about 20 s."""
    eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=max(0.0, wait))
    meta: dict[str, Any] = {"limit": limit, "eta": eta.isoformat(), "deferrals": deferrals,
                            "reason": reason}
    request = task.request
    keeps_results = not (task.ignore_result or getattr(request, "ignore_result", False))
    # A backend or broker hiccup must not turn a deferral into a failure: the
    # task is already waiting in the room or in the broker.
    with contextlib.suppress(Exception):
        if keeps_results and not isinstance(task.backend, DisabledBackend):
            task.update_state(state=THROTTLED, meta=meta)
    if task.app.conf.worker_send_task_events:
        with contextlib.suppress(Exception):
            task.send_event(EVENT, **meta)
