"""Wait notes: why and until when a task waits, for ``celery throttle why``.

One JSON value per waiting task, written at each deferral: by one SET under
``{prefix}:wait:<task id digest>`` when it is re-published with a countdown,
kept until a minute after the start it announces; by the script that parks
it, as a field of the waiting room's notes hash, moved to that key when it
arrives.  A task waiting in line notes only its entry there: the entry and
its message say the rest.  Best effort: the deferral itself is what matters.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import redis
from celery import Celery, Task
from celery.backends.base import DisabledBackend

from ..core.keys import task_key
from ..core.limits import Decision
from ..core.logs import logger
from ..room.envelope import Envelope
from ..room.header import HEADER, WaitState
from ..values import from_us, to_us
from .runtime import Runtime, runtime_for
from .visible import announce_dropped

__all__ = ["NOTE_AFTER_MS", "forget_dropped", "forget_revoked", "read_wait", "wait_note",
           "write_note"]


def _wait_key(runtime: Runtime, task_id: str) -> str:
    return task_key(runtime.config.prefix, "wait", task_id)


# A wait note is kept this long after the start it announces.
NOTE_AFTER_MS = 60_000


def wait_note(task: Task[Any, Any], limit: str, decision: Decision, state: WaitState) -> str:
    """Why and until when a task re-published with a countdown waits, for ``celery throttle
    why`` (JSON).  (A task waiting in line writes none: its entry is its note, see
    :func:`read_wait`.)
    """
    due = decision.now + to_us(decision.retry_after)
    # Compact, defaults left out (read_wait puts them back): a note is kept
    # for every waiting task, and its bytes are most of a waiting task's.
    note: dict[str, Any] = {"task": task.name, "limit": limit, "due": due,
                            "deferrals": state.deferrals, "since": state.since}
    if state.booked:
        note["booked"] = True
    if state.rerun:
        note["rerun"] = True
    return json.dumps(note, separators=(",", ":"))


def write_note(task: Task[Any, Any], runtime: Runtime, note: str, wait: float) -> None:
    """Record ``note`` (best effort): one SET per re-publish, expiring a minute after the start.

    (A parked task's note is written by the script that parks it.)
    """
    ttl_ms = int(wait * 1000) + NOTE_AFTER_MS
    # Best effort: the deferral itself is what matters; the note is for operators.
    with contextlib.suppress(redis.RedisError):
        runtime.gate.client.set(_wait_key(runtime, str(task.request.id)), note, px=ttl_ms)


def read_wait(runtime: Runtime, task_id: str) -> dict[str, Any] | None:
    """What the last deferral of ``task_id`` recorded, with times relative to now (or None).

    A task waiting in line noted only its entry ("@" and the entry id): its
    note is read from there, with its place now and an estimated start (its
    place times its limit's interval: other limits of the tasks ahead, and
    costs above one, make it later).  None once it left the line.
    """
    now, raw = runtime.room.read_note(task_id)
    if not raw:
        return None
    if raw.startswith(b"@"):
        note = _note_in_line(runtime, raw[1:].decode(), now)
        if note is None:
            return None
    else:
        note = {"booked": False, "rerun": False, **json.loads(raw)}
    note["due_in_s"] = round(from_us(note["due"] - now), 3)
    note["waiting_s"] = round(from_us(now - (note["since"] or now)), 3)
    return dict(note)


def _note_in_line(runtime: Runtime, entry: str, now: int) -> dict[str, Any] | None:
    """The note of a task waiting in line as ``entry``, from the entry and its message."""
    found = runtime.room.lines.find(entry)
    if found is None:
        return None
    line, interval = found
    headers: dict[str, Any] = Envelope.loads(line.message).headers if line.message else {}
    ours = headers.get(HEADER)
    if not isinstance(ours, dict):
        ours = {}
    return {"task": headers.get("task", "?"), "limit": line.limit,
            "due": now + (line.place + 1) * interval, "deferrals": ours.get("deferrals", 0),
            "since": ours.get("since"), "booked": False, "rerun": ours.get("rerun") == 1,
            "entry": entry, "place": line.place}


# Wait notes deleted per command (they hash alike: a cluster takes them in one DEL).
_DELETE_BATCH = 1000


def forget_dropped(app: Celery, runtime: Runtime, task_ids: list[str], reason: str) -> int:
    """Tasks dropped while they waited (they will never run): their wait notes go, and the
    app's result backend marks them REVOKED with ``reason``, so ``AsyncResult.get()`` raises
    ``TaskRevokedError`` instead of waiting forever.  Returns how many were marked (0 when
    the app has no result backend)."""
    ids = [task_id for task_id in task_ids if task_id]
    keys = [_wait_key(runtime, task_id) for task_id in ids]
    with contextlib.suppress(redis.RedisError):  # the notes expire on their own anyway
        for i in range(0, len(keys), _DELETE_BATCH):
            runtime.gate.client.delete(*keys[i:i + _DELETE_BATCH])
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        return 0
    for task_id in ids:
        backend.mark_as_revoked(task_id, reason)
    return len(ids)


def forget_revoked(app: Celery, request: Any, *, expired: bool) -> None:
    """A copy of a task that the worker dropped, revoked or expired, before the throttle saw
    it: if it had waited, nothing is left of its wait.

    A copy dispatched from the waiting room is forgotten there as an arrival
    would (else the room would dispatch it again after
    ``throttle_dispatch_timeout``, for as long as the worker remembers the
    revocation, and then run it); its wait note goes; where the node sends task
    events, a ``task-dropped`` event says so (``visible.py``).  Best effort.
    """
    state = WaitState.from_request(request)
    if not state.deferrals:
        return
    runtime = runtime_for(app)
    task_id = str(getattr(request, "id", "") or "")
    with contextlib.suppress(redis.RedisError):  # (the room's timeout sends it again)
        if state.entry and state.token:
            runtime.room.arrive(state.entry, state.token, state.room, task_id=task_id,
                                note_ttl_ms=1, kept=state.kept, patient=False)
        runtime.gate.client.delete(_wait_key(runtime, task_id))
    if app.conf.worker_send_task_events:
        try:
            announce_dropped(app, [task_id], "expired" if expired else "revoked")
        except Exception as exc:  # as the THROTTLED event, best effort
            logger.warning("celery_throttle: task-dropped event not sent: %s",
                           type(exc).__name__)
