"""The ways a task's copy leaves the worker without running.

A copy that must not run now leaves the process: it waits in its limit's
line (``line.py``), parked in the waiting room's timer, or re-published with
a countdown (on RabbitMQ on the delay ladder, ``room/ladder.py``); or it is
dropped (expired, a second copy, delivered again, its run ended, stale), or
fails (``max_wait`` passed, the store down under ``on_error="fail"``).  Each
function here returns: a way out that cannot be taken returns the action to
take instead (a copy delivered again: a drop); ``act.carry_out`` alone ends
the copy's run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import redis
from celery import Task

from .. import faults, metrics
from ..core.limits import AnyLimit, Decision
from ..core.logs import logger
from ..room.dispatcher import by_lane
from ..room.entries import entry_id
from ..room.envelope import Envelope, capture, confirmed_producer, ladder_of
from ..room.header import HEADER, WaitState
from ..values import to_us
from . import admission
from .admission import CountDown, Drop, Start, StoreFailed, WaitForStore
from .copies import Verdict, new_copy
from .notes import wait_note, write_note
from .runtime import INSTALLED, Runtime
from .visible import announce
from .waiter import Waiter

__all__ = ["copy_of", "count_down", "entry_of", "kept_beside_broker",
           "log_outage", "may_run_again", "move_pointer", "park", "pointed_copy",
           "pointer_to_run", "refuse_superseded", "republish", "room_open", "room_write_failed",
           "say_dropped", "seconds_to_expiry", "send_back", "store_down", "wait_counted_down",
           "wait_for_store", "waits_in_line"]


# A re-publish retries for about 80 s (20 tries, 0.5 s apart growing to 5 s).
_REPUBLISH_RETRY: dict[str, Any] = {"max_retries": 20, "interval_start": 0.5,
                                    "interval_step": 0.5, "interval_max": 5.0}


def seconds_to_expiry(expires: Any) -> float | None:
    """Seconds until a task's ``expires`` (as Celery carries it: ISO 8601 or a datetime;
    negative: past); None when it has none."""
    if not expires:
        return None
    when = expires if isinstance(expires, dt.datetime) else dt.datetime.fromisoformat(expires)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return (when - dt.datetime.now(dt.timezone.utc)).total_seconds()


def room_open(task: Task[Any, Any], runtime: Runtime) -> bool:
    """The waiting room is on, this app's workers run dispatchers (it was installed), and
    the store keeps a waiting task as well as the broker would (``room/durability.py``)."""
    return (runtime.config.waiting_room and getattr(task.app, INSTALLED, False)
            and runtime.durability.safe())


def kept_beside_broker(runtime: Runtime) -> bool:
    """Is a task that starts to wait now also kept beside the broker's queues
    (``room/keeper.py``: the store alone would lose it)?"""
    return runtime.room.keeper is not None and runtime.durability.verdict().kept


def entry_of(task_id: str, copy: str) -> str:
    """The waiting room's entry of a task's message copy ``copy`` (``entries.entry_id``):
    a broker that delivers that copy again (a node's warm shutdown gives back messages
    whose acknowledgement it had not sent yet) finds it waiting already."""
    return entry_id(task_id, copy)


def dropped(task: Task[Any, Any], why: Drop) -> None:
    """The task's copy ends here, never run: say so.  A copy the pointer refused keeps the
    seats held under the task's id (while the task runs or waits they are its running or
    newer copy's); an expired task is marked revoked, as Celery marks one."""
    request = task.request
    if why.reason == "expired":
        logger.info("throttle: task %s[%s] expires before its start (%.3fs away); not run",
                    task.name, request.id, why.away)
        task.backend.mark_as_revoked(str(request.id), "expired", request=request)
    else:
        say_dropped(Waiter.of_run(task), why)


def say_dropped(waiter: Waiter, why: Drop) -> None:
    """Log that the task's copy was dropped, and why (a WARNING where a node's death or a
    redelivery of a run that ended made the copy, else INFO)."""
    level = logging.WARNING if why.reason in ("ended", "stale", "running") else logging.INFO
    logger.log(level, "throttle: task %s[%s] dropped: %s", waiter.name, waiter.id,
               _DROPPED[why.reason])


_DROPPED = {
    "second copy": "a second copy dispatched from the waiting room (the first one goes on)",
    "delivered again": "its message was delivered again while it waits (the copy waiting "
                       "goes on)",
    "ended": "its run has ended (its message was delivered again)",
    "stale": "a stale copy (a node died while re-scheduling it; its newer copy goes on)",
    "running": "another copy of it has started (its message was delivered again)",
}


def log_outage(runtime: Runtime, exc: redis.RedisError, what: str) -> None:
    """Report the store being down once per 30 s per process and app, not per task."""
    # It may come back with another configuration: ask again before parking there.
    runtime.durability.invalidate()
    if runtime.outage.due():
        # The exception's text names host and port, never the password.
        logger.warning("throttle: store unavailable (%s: %s); %s", type(exc).__name__, exc,
                       what)


def store_down(runtime: Runtime, state: WaitState, exc: redis.RedisError,
               counted: Sequence[str] = ()) -> Start | WaitForStore | StoreFailed:
    """The store failed while the task was decided (counted as a store error of the
    limits ``counted`` names): the store-down policy's action, reported once in a while
    (:func:`log_outage`): run unthrottled, come back after a backoff, or fail."""
    if counted:
        metrics.store_error(list(counted))
    policy = runtime.config.on_error
    log_outage(runtime, exc, f"policy {policy!r}")
    action = admission.store_down(policy, state.deferrals, random.uniform(0.5, 1.0))
    if isinstance(action, StoreFailed):
        return replace(action, error=type(exc).__name__, cause=exc)
    return action


def wait_for_store(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                   action: WaitForStore) -> None:
    """The store is down and the policy does not let the task run: it comes back after
    ``action.seconds`` to ask again."""
    new = state.unmoved_successor(new_copy())
    # The copy pointer is not moved (the store is down): the new copy names
    # the last copy the pointer knows as its predecessor, which it accepts.
    # (No THROTTLED state here: a result backend on the store's server is down
    # too, and Celery's Redis backend retries a write for about 20 s.)
    count_down(task, runtime, new, action.seconds)
    logger.info("throttle: task %s[%s] re-scheduled in %.1fs: store unavailable (deferral %d)",
                task.name, task.request.id, action.seconds, new.deferrals)


def pointed_copy(task: Task[Any, Any], state: WaitState) -> bool:
    """Does the copy pointer (``copies.py``) decide whether this copy of ``task`` goes on?
    Every copy of an acks_late task (the broker redelivers the message of a run a crash
    cut off); of a task acknowledged early, every copy the throttle published
    (``state.copy``), which the broker may deliver twice.  The user's own message of such
    a task is Celery's (acknowledged as it starts): asking the store for it would cost
    every start a call."""
    return bool(getattr(task, "acks_late", False)) or bool(state.copy)


def may_run_again(task: Task[Any, Any]) -> bool:
    """May this delivery of a copy that started already run it again?  Only the broker's
    redelivery of an acks_late message (a run a crash or a lost connection cut off before
    its acknowledgement), which the broker flags as redelivered, as Celery's own
    ``worker_deduplicate_successful_tasks`` reads it.  Any other second delivery of a
    copy (the delay ladder's at-least-once dead-lettering, a publish the broker took
    twice) arrives unflagged, and is refused while the first runs."""
    info = getattr(task.request, "delivery_info", None) or {}
    return bool(getattr(task, "acks_late", False) and info.get("redelivered"))


def pointer_to_run(task: Task[Any, Any], runtime: Runtime, state: WaitState, *,
                   latest_us: int = 0) -> Verdict:
    """A pointed copy (:func:`pointed_copy`) about to start: may it (``CopyPointer.move``
    to "ran:")?  Once, unless this delivery of it is the broker's redelivery of an acks_late
    message (:func:`may_run_again`).  Raises ``redis.RedisError``: a start with the store
    down is the store-down policy's call (a copy re-published meanwhile names this one
    as its predecessor, so the pointer still lets exactly one through).
    """
    request = task.request
    return runtime.copies.move(str(request.id), request.retries, state, "ran:",
                               latest_us=latest_us, once=not may_run_again(task))


def move_pointer(waiter: Waiter, runtime: Runtime, state: WaitState, then: str) -> None:
    """A pointed copy (:func:`pointed_copy`) hands the pointer on: to its new copy ``then``
    (it waits as that), or to "done:" (its run ended).  Store down: nothing moves; the new
    copy names this one as its predecessor, which the pointer accepts."""
    with contextlib.suppress(redis.RedisError):
        runtime.copies.move(waiter.id, waiter.retries, state, then)


def refuse_superseded(task: Task[Any, Any], runtime: Runtime, state: WaitState
                      ) -> Drop | None:
    """A pointed copy: is it still the task's, before it gives back the seats held under
    the task's id and puts the task in line?  A copy delivered again after it was
    re-published is not: those seats may be its newer copy's, and a second copy of the
    task in line would be refused when served, with its kept copy left behind.

    Only asked, nothing moved: the pointer moves after the task is in line, so a
    node dying in between leaves this copy (redelivered) to go on.  Store down:
    the move after decides.  A :class:`Drop` when it is not the task's copy, else None.
    """
    request = task.request
    try:
        verdict = runtime.copies.check(str(request.id), request.retries, state)
    except redis.RedisError:
        return None
    return admission.verdict(verdict)


def waits_in_line(waiter: Waiter, runtime: Runtime, state: WaitState, new: WaitState,
                  blocking: AnyLimit, wait: float) -> None:
    """The task waits in ``blocking``'s line as ``new`` (about ``wait`` seconds): say so."""
    if pointed_copy(waiter.task, state):
        move_pointer(waiter, runtime, state, new.copy)
    metrics.deferred(blocking.name, wait)
    announce(waiter, limit=blocking.name, wait=wait, deferrals=new.deferrals, reason="limit")
    logger.info("throttle: task %s[%s] waits in line for limit %r (~%.3fs; deferral %d)",
                waiter.name, waiter.id, blocking.name, wait, new.deferrals)


def wait_counted_down(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
                      state: WaitState, decision: Decision, action: CountDown) -> Drop | None:
    """The task waits out of the process as a countdown (the room is closed for it, or it
    could not be put in line): re-published to come back for ``action``'s booking, or to
    when a start is within reach (None).  A copy the pointer no longer names is dropped
    instead (the :class:`Drop`), as ``join_line`` drops it: re-published, its successor
    would be refused on arrival, after a publish and a wait for nothing."""
    pointed = pointed_copy(task, state)
    if pointed:
        superseded = refuse_superseded(task, runtime, state)
        if superseded is not None:
            return superseded
    new = state.successor(new_copy(), limits, state.since or decision.now, action.booking)
    new = count_down(task, runtime, new, action.seconds)
    write_note(task, runtime, wait_note(task, action.limit, decision, new), action.wait)
    waiter = Waiter.of_run(task)
    if pointed:
        move_pointer(waiter, runtime, state, new.copy)
    metrics.deferred(action.limit, action.wait)
    announce(waiter, limit=action.limit, wait=action.wait, deferrals=new.deferrals,
             reason="limit")
    logger.info("throttle: task %s[%s] waits %.3fs for limit %r (deferral %d)",
                task.name, task.request.id, action.wait, action.limit, new.deferrals)
    return None


def send_back(task: Task[Any, Any], runtime: Runtime, state: WaitState,
              countdown: float) -> WaitState | Drop:
    """A task due again in ``countdown`` seconds, uncharged (a provider's pause), leaves the
    worker: parked in the waiting room's timer (:func:`park`) where it is open, else
    re-published with a countdown (:func:`count_down`).  Returns the copy sent, or a
    :class:`Drop` where the waiting room has this copy already."""
    parked = park(task, runtime, state, to_us(max(countdown, 0.0)))
    if isinstance(parked, Drop):
        return parked
    return state if parked else count_down(task, runtime, state, countdown)


def count_down(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                countdown: float) -> WaitState:
    """Re-publish the task with ``countdown``, at most ``throttle_max_countdown`` (a longer
    wait comes back then and asks again); return the copy the broker took.

    A copy booked for a start is aimed the dispatch lead before it, as the
    waiting room dispatches one: aimed at the booked start itself, its way to a pool
    process (the broker's delivery, the consumer, the pool's handoff) would
    make it late, past its grace, and it would lose the booked start.  The pool
    process it reaches sleeps the rest.
    """
    config = runtime.config
    if state.booked and countdown <= config.max_countdown:
        countdown -= min(config.dispatch_lead, countdown)
    return republish(task, state, min(max(countdown, 0.001), config.max_countdown))


def copy_of(task: Task[Any, Any], state: WaitState, countdown: float | None = None
            ) -> Envelope:
    """A copy of the running task's message carrying ``state`` in our header (its other
    headers kept), captured, to be stored in the waiting room or published as it is.

    ``signature_from_request`` keeps id, args, queue/routing, priority, links,
    chain, expires, time limits and ``retries`` (so ``max_retries`` is
    untouched).  Captured, then published as captured: ``apply_async`` itself
    would have the result backend subscribe to its result where joins do not
    block (see ``capture()``), once per copy.
    """
    request = task.request
    headers = {**(request.headers or {}), HEADER: state.to_header()}
    options: dict[str, Any] = {} if countdown is None else {"countdown": countdown}
    return capture(task.signature_from_request(request, headers=headers, **options))


def room_write_failed(runtime: Runtime, exc: redis.RedisError, instead: str) -> None:
    """The store failed as the task was put in the waiting room: counted, and reported
    once in a while (:func:`log_outage`); the caller does ``instead``."""
    metrics.store_error(["(waiting room)"])
    log_outage(runtime, exc, instead)


def park(task: Task[Any, Any], runtime: Runtime, state: WaitState, delay_us: int
         ) -> bool | Drop:
    """Park the task in the waiting room's timer, due ``delay_us`` from now.

    False when it cannot be parked (the waiting room is off, the app was
    never installed so no worker dispatches it, or the store failed): the
    caller re-publishes it with a countdown instead, never losing it.  A
    :class:`Drop` when the room has this copy already (its message was
    delivered again).
    """
    if not room_open(task, runtime):
        return False
    request = task.request
    entry = entry_of(str(request.id), state.prev)
    kept = kept_beside_broker(runtime)
    envelope = copy_of(task, replace(state, entry=entry, kept=kept))
    try:
        at = runtime.room.park(entry, envelope.dumps(), str(request.id), delay_us=delay_us,
                               kept=kept)
    except redis.RedisError as exc:
        room_write_failed(runtime, exc, "re-published with a countdown instead of parked")
        return False
    if not at:
        return Drop("delivered again")
    return True


def republish(task: Task[Any, Any], state: WaitState, countdown: float) -> WaitState:
    """Publish the task's new copy ``state`` to come back in ``countdown`` seconds from the
    call; return the copy the broker took (its id is the one the copy pointer moves to).

    On RabbitMQ the copy waits in the broker, on the delay ladder
    (``room/ladder.py``): no worker holds it meanwhile.  On a Redis broker it
    carries an ETA, and the worker that receives it holds it until then.

    A publish that fails with the connection is tried again on a new connection,
    as kombu retries it, but each attempt is a copy of its own (a new copy id):
    an attempt whose confirm was lost with the connection may still have reached
    the broker, and a second copy identical to it would pass the copy pointer as
    acks_late's redelivery of the first, and run beside it.  Copies with ids of
    their own both name this copy as their predecessor: whichever arrives first
    takes the pointer and the other is refused.
    """
    app = task.app
    sent: list[WaitState] = []
    asked = time.monotonic()

    def attempt(producer: Any) -> None:
        this = replace(state, copy=new_copy()) if sent else state
        sent.append(this)
        # Counted from now, not from the publish: a publish that takes long (a new
        # connection, the ladder's declaration, a retry) must not make it late.
        left = max(countdown - (time.monotonic() - asked), 0.001)
        if ladder is None:  # (a Redis broker: an ETA, held by the worker it reaches)
            envelope = by_lane(copy_of(task, this, countdown=left))
            envelope.publish(producer, queues=app.amqp.queues, retry=False)
        else:  # RabbitMQ: it waits in the broker, on the delay ladder
            envelope = by_lane(copy_of(task, this))
            ladder.send(producer, envelope, left, app.amqp.queues)
        faults.at("defer.published", task)

    ladder = ladder_of(app)
    with confirmed_producer(app) as producer:
        policy = _outlasting(app.conf.task_publish_retry_policy)
        producer.connection.ensure(producer, lambda: attempt(producer), **policy)()
    faults.at("defer.after_republish", task)
    return sent[-1]


def _outlasting(policy: Mapping[str, Any] | None) -> dict[str, Any]:
    """The app's publish retry policy, stretched to outlast a broker's restart.

    A task that must wait and cannot be sent back has nowhere to go: Celery's
    default policy gives up within a second, and the task would fail with
    the broker's error, never run.  Waiting for the broker holds one pool
    process, which has nothing to take from a broker that is down anyway.
    """
    merged = {**_REPUBLISH_RETRY, **(policy or {})}
    if merged.get("max_retries") is not None:  # (None: for ever, as kombu's ensure reads it)
        merged["max_retries"] = max(int(merged["max_retries"]),
                                    int(_REPUBLISH_RETRY["max_retries"]))
    merged["interval_max"] = max(float(merged.get("interval_max") or 0.0),
                                 float(_REPUBLISH_RETRY["interval_max"]))
    return merged
