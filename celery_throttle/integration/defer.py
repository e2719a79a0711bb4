"""Admitting a gated task: ask the gate, return what ``admission.py`` decides.

:func:`admit` asks the gate (``core/gate.py``) for every limit of the task at
once and returns the action ``act.carry_out`` does.  Allowed: the task runs,
holding its seats (``leases.py``) in its run (``run.py``).  A short wait
(``throttle_max_sleep``): it sleeps and claims its booked start.  A longer
one: it waits outside the worker, in its limit's line (``line.py``) or, where
the waiting room is closed to it, re-published with a countdown; how a copy
leaves, and every other way it ends without running (expiry, ``max_wait``, a
stale copy, the store down), is ``exits.py``.  A copy dispatched from its line
comes back charged for its turn: it checks its seats and its start are still
its own.  What a copy needs on its next arrival travels in one header
(``room/header.py``); an ``acks_late`` task's copies, and the copies the
throttle published of any task, are told apart by the copy pointer
(``copies.py``).  After the start: ``after_start.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import redis
from celery import Task

from .. import faults, metrics
from ..core import waiting
from ..core.limits import AnyLimit, Concurrency, Decision, Reservation, rates_of, seats_of
from ..core.logs import logger
from ..room.dispatcher import queue_of
from ..room.header import STARTED, WaitState
from ..room.lines import MAX_AHEAD_US
from ..values import from_us, to_us
from . import admission, leases, shadow
from .act import Leave
from .admission import Action, Drop, Known, Start, StoreFailed, TimeOut, WaitForStore
from .exits import (
    may_run_again,
    pointed_copy,
    pointer_to_run,
    room_open,
    seconds_to_expiry,
    store_down,
)
from .line import in_line_horizon
from .notes import NOTE_AFTER_MS
from .run import Run, rewrite, run_of, start_run
from .runtime import Runtime

__all__ = ["admit", "admitted_late"]


_MAX_SLEEPS = 2  # sleeps for a booked start in a worker; lost again after them: wait outside


def admitted_late(task: Task[Any, Any]) -> float:
    """How long after the start it was admitted for the running task was let go (seconds;
    0 when admitted at once): a gated transport's request spends the admission only
    within its window of that start, not of this late moment (``transport.py``)."""
    run = run_of(task.request)
    return run.late if run is not None else 0.0


def admit(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
          max_wait: float | None, estimated: set[str] | None = None,
          coded: Mapping[str, bool] | None = None) -> tuple[Action, Leave]:
    """What to do with ``task`` now, and what its way out needs (``act.carry_out`` does
    it): :class:`Start` when it may start now (its seats are held, its run records what it
    was admitted under); any other action: it waits elsewhere, is dropped, or fails.

    ``limits``: the call's, at the rates in force (``throttled.call_of``).
    Concurrency limits are held under the task's id until its run ends
    (``task_postrun``), renewed meanwhile by this process's heartbeat.
    ``estimated``: names of limits whose cost the task may settle.  ``coded``:
    limit name -> the decorator's ``enforce``: limits in shadow mode
    (``shadow.py``) are decided once the others admit the task, and never hold it.
    """
    request = task.request
    run = start_run(request, runtime)
    runtime.counts.start()  # (once per process) the per-second history the dashboard reads
    limits, shadowed = shadow.split(runtime, limits, coded or {})
    state = _run_again_uncharged(task, runtime, WaitState.from_request(request))
    info: Mapping[str, Any] = request.delivery_info or {}
    came_by = str(info.get("routing_key") or "")
    if came_by and queue_of(came_by) != came_by:
        # Came by its queue's lane (dispatched, or re-published to wait): a copy made
        # from here on goes to the task's queue, as the task was sent (retry() and
        # parking again take the routing from delivery_info).  Copied only then: the
        # common arrival by the queue itself costs nothing here.
        rewrite(request, routing_key=queue_of(came_by))
    arrived = state.entry  # dispatched from the waiting room as this entry ("" if not)
    start = Start()
    # Dispatched for its turn and in time for it: the latest it may start (server clock,
    # us; 0: any time), else None.
    turn: int | None = None
    if arrived:
        went, state, turn = _arrival(task, run, limits, state, max_wait)
        if not isinstance(went, Start):
            return went, Leave(limits, state)
    if limits and turn is None:
        asked, leave = _wait_for_start(task, run, limits, max_wait, state, arrived)
        if not isinstance(asked, Start):
            return asked, leave
        start = asked
    if pointed_copy(task, state):
        # Before the seats are held: a copy refused here must not keep them renewed.
        taken, leave = _take_the_pointer(task, run, limits, max_wait, state, arrived, start,
                                         turn or 0)
        if not isinstance(taken, Start):
            return taken, leave
        start = taken
        run.started = state  # for run_ended
    _start(task, run, limits, shadowed, state, estimated or set(), held=start.held)
    return start, Leave(limits, state)


def _arrival(task: Task[Any, Any], run: Run, limits: list[AnyLimit], state: WaitState,
             max_wait: float | None) -> tuple[Action, WaitState, int | None]:
    """A copy dispatched from the waiting room arrives: the first of its entry goes on
    (:class:`Start`), with the entry taken from its state; a copy charged for its turn
    that still holds its seats and is in time for it comes with the latest it may start
    (server clock, us; 0: any time; None: it asks the gate)."""
    runtime = run.runtime
    asked = time.monotonic()  # (this process's clock before the arrival is asked)
    try:
        arrived_at = _first_arrival(task, runtime, state)
    except redis.RedisError as exc:
        down = store_down(runtime, state, exc, ["(waiting room)"])
        if not isinstance(down, Start):
            return down, state, None
        arrived_at = 0  # (policy "allow": on as the first)
    served = state.charged if limits else ""  # (every limit in shadow mode: nothing to serve)
    ended = admission.arrived(
        served, first=arrived_at is not None, limit=limits[0].name if limits else "",
        waited=_waited(runtime, state) if served == "t" else 0.0, max_wait=max_wait)
    if ended is not None:
        return ended, state, None
    # The entry is taken: a copy made from here on (re-published while the store is
    # down, too) is a new one, which its arrival must not find spent.
    taken = replace(state, entry="", token="", room=0, charged="", kept=False)
    turn = None
    if state.charged == "c" and limits:
        concurrent = seats_of(limits)
        held = _seats_still_held(task, runtime, concurrent, taken)
        if not isinstance(held, bool):
            if not isinstance(held, Start):
                return held, taken, None
            held = True  # (policy "allow")
        if held and _in_time_for_its_start(task, run, limits, taken, arrived_at, asked):
            # Its turn came in its line: every limit was charged for it.
            turn = _latest_start(runtime, limits, taken)
    return Start(), taken, turn


def _take_the_pointer(task: Task[Any, Any], run: Run, limits: list[AnyLimit],
                      max_wait: float | None, state: WaitState, arrived: str,
                      action: Start, latest: int) -> tuple[Action, Leave]:
    """A pointed copy (``exits.pointed_copy``) admitted: may it start (the copy pointer
    moves to "ran:")?  ``action``: how it was admitted.  A first "late" verdict (the store
    answered after its turn) asks the gate again, once."""
    runtime = run.runtime
    verdict = _pointer(task, runtime, state, latest)
    if verdict == "late":
        logger.info("throttle: task %s[%s] ready after its turn (the store answered "
                    "late); in line again", task.name, task.request.id)
        again, leave = _wait_for_start(task, run, limits, max_wait, state, arrived)
        if not isinstance(again, Start):
            return again, leave
        action = again
        verdict = _pointer(task, runtime, state, 0)
    if not isinstance(verdict, str):
        return verdict, Leave(limits, state)
    refused = admission.verdict(verdict)
    if refused is None:
        return action, Leave(limits, state)
    concurrent = seats_of(limits)
    if refused.reason == "ended" and action.held and concurrent:
        # The task's run has ended: the seats just given under its id are this copy's
        # alone, and go back now rather than a lease later.  (A newer copy's, given at its
        # dispatch, stay: see exits.dropped.)
        with contextlib.suppress(redis.RedisError):
            runtime.gate.release(concurrent, str(task.request.id))
    return refused, Leave(limits, state)


def _pointer(task: Task[Any, Any], runtime: Runtime, state: WaitState, latest: int
             ) -> str | WaitForStore | StoreFailed:
    """The copy pointer's verdict on this copy's start ("go" where the store is down and the
    policy lets the task run as admitted), or the store-down policy's action."""
    try:
        return pointer_to_run(task, runtime, state, latest_us=latest)
    except redis.RedisError as exc:
        down = store_down(runtime, state, exc)
        return "go" if isinstance(down, Start) else down


def _start(task: Task[Any, Any], run: Run, limits: list[AnyLimit], shadowed: list[AnyLimit],
           state: WaitState, estimated: set[str], *, held: bool) -> None:
    """The task starts now: record what it was admitted under (``held``: by the gate, its
    seats held, not by the store-down policy) and what its next copy must carry."""
    request = task.request
    runtime = run.runtime
    concurrent = seats_of(limits)
    if held:
        if concurrent:
            # Recorded before anything else may raise: the gated run gives it back.
            run.leased = leases.hold(runtime.gate, concurrent, str(request.id))
        run.admitted = leases.Admitted(runtime.gate, limits, estimated)
    if shadowed:  # it starts now: what would the shadowed limits have said?
        run.shadow_leased = shadow.decide(task, runtime, shadowed)
    metrics.admitted([lim.name for lim in limits + shadowed])
    if state.start is not None or state.since is not None:
        # The task starts now: its booked start is spent.  Celery's retry() and
        # any re-publish copy request.headers, and a copy still carrying the
        # claim could be honoured a second time within the grace.
        rewrite(request, header={**WaitState(deferrals=state.deferrals).to_header(),
                                 STARTED: state.start})


def _wait_for_start(task: Task[Any, Any], run: Run, limits: list[AnyLimit],
                    max_wait: float | None, state: WaitState, arrived: str = ""
                    ) -> tuple[Action, Leave]:
    """Ask the gate, sleeping here for a start booked close by (the waiting loop of every
    waiter, ``core/waiting.py``), until the task may start (:class:`Start`, ``run.late``
    set) or must wait out of the process, be dropped or fail (the action, and what its way
    out needs)."""
    request = task.request
    runtime = run.runtime
    config = runtime.config
    to_expiry = seconds_to_expiry(getattr(request, "expires", None))
    in_line = room_open(task, runtime)
    known = Known(
        limits,
        max_sleep=admission.longest_sleep(config.max_sleep, config.dispatch_lead,
                                          bool(arrived or state.booked)),
        horizon=admission.booking_horizon(
            in_line_horizon(runtime) if in_line else config.horizon, to_expiry, max_wait),
        shortest=config.max_sleep, to_expiry=to_expiry, max_wait=max_wait,
        since=state.since or 0, in_line=in_line)
    holder = str(request.id) if seats_of(limits) else ""

    # A short wait is slept, then the booked start claimed (the claim is what charges
    # the limits the start is not booked in).  Bounded: if the start is lost again and
    # again, the task waits outside the worker instead.  Any refusal not slept (a drop,
    # a time-out, a wait out of the process) ends the plan, for admission.settled.
    def elsewhere(decision: Decision) -> bool:
        return not isinstance(admission.refused(known, decision), admission.Sleep)

    def ask(step: waiting.Ask) -> Decision:
        if step.late:
            logger.info("throttle: task %s[%s] ready %.3fs after its booked start; asking again",
                        task.name, request.id, step.late)
        decision = runtime.gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                             grace=step.grace, holder=holder,
                                             in_line=step.in_line, near=step.near)
        if step.claim is not None and step.claim.booked and not decision.allowed \
                and not decision.early:
            # Arrived after its start's grace, or a limit it was not booked in is busy:
            # the start is lost (a little throughput) rather than used late (that
            # could burst).
            logger.info("throttle: task %s[%s] lost its booked start (%.3fs ago); asking again",
                        task.name, request.id, from_us(decision.now - step.claim.start))
        return decision

    def sleep(step: waiting.Sleep) -> None:
        time.sleep(step.seconds)
        if step.admitted:
            faults.at("defer.start_slept", task)

    def give_back(booking: Reservation | None) -> None:
        if booking is not None:  # (interrupted: a time limit, a shutdown)
            with contextlib.suppress(redis.RedisError):
                runtime.gate.cancel(limits, booking)

    steps = waiting.plan(limits, near=0.0, horizon=known.horizon, in_line=in_line,
                         grace=lambda booked: admission.grace(limits, booked,
                                                              config.claim_grace),
                         claim=state.claim_under(limits), elsewhere=elsewhere,
                         max_sleeps=_MAX_SLEEPS)
    try:
        outcome = waiting.drive(steps, ask, sleep, give_back)
    except redis.RedisError as exc:
        return store_down(runtime, state, exc, [lim.name for lim in limits]), Leave(limits,
                                                                                   state)
    action = admission.settled(known, outcome)
    if isinstance(action, Start):
        run.late = max(0.0, action.late)
    elif isinstance(action, (Drop, TimeOut)):
        # It will not wait: a start booked for it goes back.
        give_back(outcome.decision.reservation if outcome.decision.reservation is not None
                  and outcome.decision.reservation.booked else None)
    return action, Leave(limits, state, outcome.decision, known)


def _run_again_uncharged(task: Task[Any, Any], runtime: Runtime, state: WaitState) -> WaitState:
    """``state``, or, when this delivery runs again a copy whose run a crash cut off, that
    copy without the start it carries (:meth:`WaitState.uncharged`): a new call.

    Only a delivery that may run a started copy again (:func:`~.exits.may_run_again`: the
    broker flagged it as its redelivery of an acks_late message) asks the copy pointer
    here, which costs no other start a store call.  A redelivery of a copy that never
    started (a node killed with it prefetched) goes on as it is.  Store down: as it is (the
    store-down policy decides its start).
    """
    if not (may_run_again(task) and pointed_copy(task, state)):
        return state
    request = task.request
    try:
        verdict = runtime.copies.check(str(request.id), request.retries, state)
    except redis.RedisError:
        return state
    if verdict != "rerun":
        return state
    logger.warning("throttle: task %s[%s] run again after its node died: waits for a start",
                   task.name, request.id)
    return state.uncharged()


def _seats_still_held(task: Task[Any, Any], runtime: Runtime, concurrent: list[Concurrency],
                      state: WaitState) -> bool | Start | WaitForStore | StoreFailed:
    """A task dispatched from its line with seats taken for it: are they still its own?

    The seats were taken at dispatch for a lease's time, renewed by nobody
    while the copy travels.  A copy that comes later than that (its node was
    killed and the broker restored it after its visibility timeout) may find
    them given to the next in line: it takes a free one again, or asks again.  The
    store down: the store-down policy's action.
    """
    if not concurrent:
        return True
    try:
        lost = runtime.gate.extend(concurrent, str(task.request.id))
    except redis.RedisError as exc:
        return store_down(runtime, state, exc, [lim.name for lim in concurrent])
    if lost:
        logger.info("throttle: task %s[%s] arrived after its seat was given to another; "
                    "asking again", task.name, task.request.id)
    return not lost


def _in_time_for_its_start(task: Task[Any, Any], run: Run, limits: list[AnyLimit],
                           state: WaitState, arrived_at: int | None, asked: float) -> bool:
    """A task dispatched from its line: wait for the start it was charged for; in time?

    It arrives ahead of that moment by at most the dispatch's lead
    (``lines.MAX_AHEAD_US``) and sleeps until then.  Later than the grace
    (``_grace``), arriving late or woken late (a loaded machine, a container
    out of its CPU quota, can run a sleeping process 100 ms after its
    timer), starting would put two starts closer than an interval (the next
    task keeps its own moment): its turn is lost (a little throughput) and
    it asks again, in line, keeping its place.  The check comes after the
    sleep: the server's clock now is at most its time at the arrival plus
    what this process's clock counted since it asked (``asked``, monotonic).
    """
    if not state.start or not arrived_at or not rates_of(limits):
        return True  # (a seat alone: its lease is taken already, lateness spends nothing)
    late = _slept_to_start(task, asked, min(from_us(state.start - arrived_at),
                                            from_us(MAX_AHEAD_US)))
    start = admission.turn(late, _turn_grace(run.runtime, limits))
    if start is not None:
        run.late = max(0.0, start.late)
        return True
    logger.info("throttle: task %s[%s] ready %.3fs after its turn; in line again",
                task.name, task.request.id, late)
    return False


def _turn_grace(runtime: Runtime, limits: list[AnyLimit]) -> float:
    """How late a task may start in a turn it was charged for (every limit was charged)."""
    return admission.grace(limits, (1 << len(limits)) - 1, runtime.config.claim_grace)


def _latest_start(runtime: Runtime, limits: list[AnyLimit], state: WaitState) -> int:
    """The latest a task admitted for its turn may start (server clock, us; 0: any time):
    its start plus the grace ``_in_time_for_its_start`` allowed it (the same start, rechecked in the
    last store call before it starts)."""
    if not state.start or not rates_of(limits):
        return 0
    return state.start + to_us(_turn_grace(runtime, limits))


def _slept_to_start(task: Task[Any, Any], asked: float, ahead: float) -> float:
    """Sleep until a start ``ahead`` seconds after the moment this process asked for it
    (``asked``, its monotonic clock); how late it woke (``waiting.late_by``: seconds; a
    start already past, ``ahead`` < 0, counts too).  The caller tells a late start from
    a timely one by the grace (``_grace``)."""
    if ahead > 0:
        time.sleep(ahead)
    faults.at("defer.start_slept", task)
    return waiting.late_by(asked, ahead)


def _waited(runtime: Runtime, state: WaitState) -> float:
    """Seconds since the task first waited (0 if unknown or the store is down)."""
    if not state.since:
        return 0.0
    try:
        sec, usec = runtime.gate.client.time()
    except redis.RedisError:
        return 0.0
    return max(0.0, from_us(int(sec) * 1_000_000 + int(usec) - state.since))


def _first_arrival(task: Task[Any, Any], runtime: Runtime, state: WaitState) -> int | None:
    """A copy dispatched from the waiting room: is it the first of its entry to arrive?

    None: no; else the server's time (us).  Raises ``redis.RedisError``: with
    the store down this is the store-down policy's call (``defer``
    re-publishes the copy, still naming its entry, so exactly one copy of
    the entry goes on once the store is back).
    """
    acks_late = getattr(task, "acks_late", False)
    # acks_late: the broker may redeliver this copy after a crash mid-run,
    # as late as its visibility timeout; the marker must outlive that.
    ttl_ms = int(runtime.config.visibility_timeout * 1000) + 60_000 if acks_late else 0
    now = runtime.room.arrive(state.entry, state.token, state.room, marker_ttl_ms=ttl_ms,
                              task_id=str(task.request.id), note_ttl_ms=NOTE_AFTER_MS,
                              kept=state.kept, held_us=state.held)
    return now or None
