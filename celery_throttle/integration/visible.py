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

A waiting task that is dropped (``celery throttle purge``, or revoked or
expired while it waits) is marked ``REVOKED`` in the result backend
(``notes.forget_dropped``; Celery's own worker marks a revoked one), and a
``task-dropped`` event says so with its reason: Celery's event state ranks
``REVOKED`` below any custom state, so after THROTTLED only another custom
state shows, and the task shows ``DROPPED`` instead of waiting for ever.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import threading
import weakref
from typing import Any

from celery import Celery, Task
from celery.backends.base import DisabledBackend

from .waiter import Waiter

__all__ = ["DROPPED_EVENT", "THROTTLED", "announce", "announce_dropped", "backend_of"]

#: The state of a task that waits for its booked start outside the worker.
THROTTLED = "THROTTLED"
#: The task event announcing it (Celery's event state shows it as THROTTLED).
EVENT = "task-throttled"
#: The task event of a waiting task dropped (shown as DROPPED), with its reason.
DROPPED_EVENT = "task-dropped"
#: Events sent in one message by :func:`announce_dropped`.
_EVENTS_PER_MESSAGE = 500


# One result backend per app and process for these writes: Celery's
# ``app.backend`` is a new instance, with its own connection, in every thread,
# and under the gevent and eventlet pools every task's greenlet is one: a
# backend built and connected per deferral would cost a node a good part of its
# CPU while it parks a backlog.  Celery's tracer shares one across its pool the
# same way.
_backends: weakref.WeakKeyDictionary[Celery, tuple[int, Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # (the threads pool)


def backend_of(task: Task[Any, Any]) -> Any:
    """The result backend ``task``'s THROTTLED state goes to: its own, else its app's, one
    per process."""
    own = getattr(task, "_backend", None)  # (Task.backend's own first choice)
    if own is not None:
        return own
    app = task.app
    with _lock:
        kept = _backends.get(app)
        if kept is None or kept[0] != os.getpid():  # (a prefork child: its own)
            kept = _backends[app] = (os.getpid(), app.backend)
    return kept[1]


def announce(waiter: Waiter, *, limit: str, wait: float, deferrals: int,
             reason: str) -> None:
    """Record that ``waiter`` waits ``wait`` seconds for ``limit`` (``reason``: "limit", or
    "provider" for a 429's pause).  Not called while the throttle's store is down: a result
    backend on the same server would be down too, and Celery's Redis backend retries a
    write for about 20 s."""
    eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=max(0.0, wait))
    meta: dict[str, Any] = {"limit": limit, "eta": eta.isoformat(), "deferrals": deferrals,
                            "reason": reason}
    task = waiter.task
    keeps_results = not (task.ignore_result or waiter.ignore_result)
    # A backend or broker hiccup must not turn a deferral into a failure: the
    # task is already waiting in the room or in the broker.
    with contextlib.suppress(Exception):
        backend = backend_of(task)
        if keeps_results and not isinstance(backend, DisabledBackend):
            backend.store_result(waiter.id, meta, THROTTLED, request=waiter.request)
    if waiter.send_event is not None:
        with contextlib.suppress(Exception):
            waiter.send_event(EVENT, **meta)


def announce_dropped(app: Celery, task_ids: list[str], reason: str) -> int:
    """Send ``task-dropped`` (``reason``) for each of ``task_ids``, tasks that waited and will
    never run, in messages of up to 500 events; returns how many were sent.

    Sent from any process (the CLI's purge too) to the broker's event
    exchange, whether or not anyone listens: where nobody does, the broker
    drops them.  A broker error is left to the caller.
    """
    ids = [task_id for task_id in task_ids if task_id]
    if not ids:
        return 0
    with app.connection_or_acquire() as connection:  # (the app's pool: no connect per call)
        dispatcher = app.events.Dispatcher(connection, enabled=True, buffer_group=["task"],
                                           buffer_limit=_EVENTS_PER_MESSAGE)
        try:
            for task_id in ids:
                dispatcher.send(DROPPED_EVENT, uuid=task_id, reason=reason)
            dispatcher.flush()
        finally:
            dispatcher.close()
    return len(ids)

