"""Making an over-limit task wait for its slot: the flow, top to bottom.

:func:`admit` asks the gate (``core/gate.py``) for every limit of the task at once.
Allowed: the task runs.  A short wait (``throttle_max_sleep``): it sleeps and
claims its booked slot.  A longer one: the task waits outside the worker,
parked in the waiting room (``room/parking.py``, sent on by
``room/dispatcher.py``) or, without it, re-published with a countdown (in hops of at most
``throttle_max_countdown``; on RabbitMQ the copy waits in the broker on the delay
ladder, ``room/ladder.py``, not in a worker); then the running copy ends with Celery's
``Ignore`` (its message is acknowledged, no result is stored).  What it needs
on its next arrival travels in one header (``room/header.py``); why it waits
is noted for ``celery throttle why`` (``notes.py``); an ``acks_late`` task's
copies are told apart by the copy pointer (``copies.py``).  Expiry,
``max_wait``, a provider's 429 and the store being down are handled here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import random
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NoReturn

import redis
from celery import Task
from celery.exceptions import Ignore

from .. import faults, metrics
from ..core import waiting
from ..core.gate import AnyLimit, Concurrency, Decision, Limit, Reservation
from ..core.logs import logger
from ..errors import ThrottleStoreError, ThrottleTimeout
from ..room.dispatcher import by_lane, queue_of
from ..room.envelope import Envelope, capture, confirmed_producer, ladder_of
from ..room.header import HEADER, WaitState, spacing_of
from ..room.queues import MAX_AHEAD_US, entry_id
from ..values import from_us, to_us
from . import admission, leases, shadow
from .admission import CountDown, Drop, JoinLine, Known, Start, TimeOut
from .copies import Verdict, new_copy
from .notes import NOTE_AFTER_MS, wait_note, write_note
from .run import Run, rewrite, run_of, start_run
from .runtime import INSTALLED, Runtime
from .visible import announce

__all__ = ["admit", "admitted_late", "defer_after_start", "join_line_on_arrival",
           "release_leases_of", "run_ended"]


_MAX_SLEEPS = 2  # sleeps for a booked slot in a worker; lost again after them: wait outside
# A re-publish retries for about 80 s (20 tries, 0.5 s apart growing to 5 s).
_REPUBLISH_RETRY: dict[str, Any] = {"max_retries": 20, "interval_start": 0.5,
                                    "interval_step": 0.5, "interval_max": 5.0}


def admitted_late(task: Task[Any, Any]) -> float:
    """How long after the start it was admitted for the running task was let go (seconds;
    0 when admitted at once): a gated transport's request spends the admission only
    within its window of that start, not of this late moment (``transport.py``)."""
    run = run_of(task.request)
    return run.late if run is not None else 0.0


def _seconds_to_expiry(request: Any) -> float | None:
    expires = getattr(request, "expires", None)
    if not expires:
        return None
    when = expires if isinstance(expires, dt.datetime) else dt.datetime.fromisoformat(expires)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return (when - dt.datetime.now(dt.timezone.utc)).total_seconds()


def admit(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
          max_wait: float | None, estimated: set[str] | None = None,
          coded: Mapping[str, bool] | None = None) -> None:
    """Return when ``task`` may start now; otherwise re-schedule it and raise ``Ignore``.

    Raises :class:`ThrottleTimeout` past ``max_wait`` and
    :class:`ThrottleStoreError` when the store fails under ``on_error="fail"``.
    Concurrency limits are held under the task's id until its run ends
    (``task_postrun``), renewed meanwhile by this process's heartbeat.
    ``estimated``: names of limits whose cost the task may settle.  ``coded``:
    limit name -> the decorator's ``enforce``: limits in shadow mode
    (``shadow.py``) are decided once the others admit the task, and never hold it.
    """
    request = task.request
    run = start_run(request, runtime)
    runtime.counts.start()  # (once per process) the per-second history the dashboard reads
    limits = runtime.live.apply(limits)  # the rates set at run time (core/live.py)
    limits, shadowed = shadow.split(runtime, limits, coded or {})
    state = WaitState.from_request(request)
    arrived = state.entry  # dispatched from the waiting room as this entry ("" if not)
    charged = state.charged  # ... from a limit's queue: how (queues.Served.flag)
    arrived_at: int | None = 0  # the server's time when it arrived (0: unknown)
    asked = 0.0  # (this process's clock before the arrival is asked: see _turn_kept)
    info: Mapping[str, Any] = request.delivery_info or {}
    came_by = str(info.get("routing_key") or "")
    if came_by and queue_of(came_by) != came_by:
        # Came by its queue's lane (dispatched, or re-published to wait): a copy made
        # from here on goes to the task's queue, as the task was sent (retry() and
        # parking again take the routing from delivery_info).  Copied only then: the
        # common arrival by the queue itself costs nothing here.
        rewrite(request, routing_key=queue_of(came_by))
    if arrived:
        asked = time.monotonic()
        arrived_at = _first_arrival(task, runtime, state)
        served = charged if limits else ""  # (every limit in shadow mode: nothing to serve)
        ended = admission.arrived(
            served, first=arrived_at is not None, limit=limits[0].name if limits else "",
            waited=_waited(runtime, state) if served == "t" else 0.0, max_wait=max_wait)
        if ended is not None:
            _end(task, ended)
        # The entry is taken: a copy made from here on is a new one.
        state = replace(state, entry="", token="", room=0, charged="", kept=False)
    concurrent = [lim for lim in limits if isinstance(lim, Concurrency)]
    holder = str(request.id) if concurrent else ""
    latest = 0  # the latest it may start, server clock (us; 0: any time)
    if not limits:
        admitted = True  # (every limit is in shadow mode)
    elif charged == "c" and arrived and _seats_kept(task, runtime, concurrent, holder, state) \
            and _turn_kept(task, run, limits, state, arrived_at, asked):
        admitted = True  # its turn came in its queue: every limit was charged for it
        latest = _latest_start(runtime, limits, state)
    else:
        admitted = _wait_for_slot(task, run, limits, max_wait, state, holder, arrived)
    if getattr(task, "acks_late", False):
        # Before the seats are held: a copy refused here must not keep them renewed.
        verdict = _move_pointer(task, runtime, state, "ran:", latest_us=latest)
        if verdict == "late":
            logger.info("throttle: task %s[%s] ready after its turn (the store answered "
                        "late); in line again", task.name, request.id)
            admitted = _wait_for_slot(task, run, limits, max_wait, state, holder, arrived)
            verdict = _move_pointer(task, runtime, state, "ran:")
        refused = admission.verdict(verdict)
        if refused is not None:
            if refused.reason == "ended" and admitted and concurrent:
                # The task's run has ended: the seats just given under its id are
                # this copy's alone, and go back now rather than a lease later.  (A
                # newer copy's, given at its dispatch, stay: see _drop.)
                with contextlib.suppress(redis.RedisError):
                    runtime.gate.release(concurrent, holder)
            _drop(task, refused)
        run.started = state  # for run_ended
    if admitted:
        if concurrent:
            # Recorded before anything else may raise: the gated run gives it back.
            run.leased = leases.hold(runtime.gate, concurrent, holder)
        run.admitted = leases.Admitted(runtime.gate, limits, estimated or set())
    if shadowed:  # it starts now: what would the shadowed limits have said?
        run.shadow_leased = shadow.decide(task, runtime, shadowed)
    metrics.admitted([lim.name for lim in limits + shadowed])
    if state.slot is not None or state.since is not None:
        # The task starts now: its booked slot is spent.  Celery's retry() and
        # any re-publish copy request.headers, and a copy still carrying the
        # claim could be honoured a second time within the grace.
        rewrite(request, header={**WaitState(deferrals=state.deferrals).to_header(),
                                 "started_slot": state.slot})


def run_ended(task: Task[Any, Any]) -> None:
    """acks_late: this copy's run ended and its outcome is stored; no copy may run it again.

    Called from ``task_postrun`` by the receiver ``install(app)`` connects for
    its app: Celery sends it after the result is stored and callbacks are
    sent, so a node dying before then leaves "ran:", and the redelivered
    message runs again (acks_late's at-least-once) instead of being dropped
    with no result.  A run cut off by its process's exit (Celery sends the
    signal with no state) is not ended: the receiver does not call this.
    """
    run = run_of(getattr(task, "request", None))
    if run is not None and run.started is not None:
        state, run.started = run.started, None
        _move_pointer(task, run.runtime, state, "done:")


def release_leases_of(task: Task[Any, Any]) -> None:
    """Give back the concurrency leases the current run of ``task`` holds, once.

    The gated run calls it as the run ends in any state (success, failure,
    retry, ``Ignore``, soft time limit), and after a provider's pause is written.
    """
    run = run_of(task.request)
    if run is None:
        return
    held, shadow_held = run.leased, run.shadow_leased
    run.leased = run.shadow_leased = None
    for each in (held, shadow_held):
        if each is not None:
            leases.release(each)


def defer_after_start(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
                      seconds: float) -> NoReturn:
    """The provider refused the call (429): pause ``limits`` everywhere, re-schedule the task.

    The pause is written to the gate, so every worker's next decision for
    these limits waits it out, and slots booked before it ends are void.
    The task comes back after ``seconds`` (in hops of at most
    ``throttle_max_countdown``) and asks the gate again; its retries are
    not spent.  With the store down the task is still re-scheduled.
    """
    request = task.request
    run = run_of(request)
    state = run.started if run is not None and run.started is not None \
        else WaitState.from_request(request)
    if run is not None:
        run.started = None  # this copy's run did not complete
    refused = sorted({lim.name for lim in limits})
    names = ", ".join(refused)
    metrics.provider_paused(refused)
    store_up = True
    try:
        seconds = max(seconds, runtime.gate.pause(limits, seconds))
    except redis.RedisError as exc:
        store_up = False
        metrics.store_error([lim.name for lim in limits])
        logger.warning("throttle: could not pause %s (%s: %s); task %s[%s] waits %.3fs anyway",
                       names, type(exc).__name__, exc, task.name, request.id, seconds)
    # Only now: a seat freed before the pause was written could let another
    # call through to the provider that just refused.
    release_leases_of(task)
    new = WaitState(deferrals=state.deferrals + 1, since=state.since, copy=new_copy(),
                    prev=state.copy_id, spacing=spacing_of(limits))
    new = _send_back(task, runtime, new, seconds)
    if getattr(task, "acks_late", False):
        _move_pointer(task, runtime, state, new.copy)
    metrics.deferred(limits[0].name if limits else "(provider)", seconds)
    if store_up:  # (as in the store-down path, a backend beside it may be down too)
        announce(task, limit=names or "(provider)", wait=seconds, deferrals=new.deferrals,
                 reason="provider")
    logger.info("throttle: task %s[%s] refused by the provider: %s paused %.3fs on every "
                "worker; re-scheduled (deferral %d)", task.name, request.id, names, seconds,
                new.deferrals)
    raise Ignore()


def _wait_for_slot(task: Task[Any, Any], run: Run, limits: list[AnyLimit],
                   max_wait: float | None, state: WaitState, holder: str,
                   arrived: str = "") -> bool:
    """Return True when the gate admitted the task, False when the store-down policy did;
    otherwise the task waits out of the process (or fails) and this raises."""
    request = task.request
    runtime = run.runtime
    config = runtime.config
    to_expiry = _seconds_to_expiry(request)
    in_line = _room_open(task, runtime)
    known = Known(
        limits,
        max_sleep=admission.longest_sleep(config.max_sleep, config.dispatch_lead,
                                          bool(arrived or state.booked)),
        horizon=admission.booking_horizon(
            config.horizon, to_expiry, max_wait,
            min(config.max_sleep, _handed_out_within(runtime)) if in_line else None),
        shortest=config.max_sleep, to_expiry=to_expiry, max_wait=max_wait,
        since=state.since or 0, in_line=in_line)

    # A short wait is slept, then the booked start claimed (the claim is what charges
    # the limits the start is not booked in): the waiting loop of every waiter
    # (core/waiting.py).  Bounded: if the start is lost again and again, the task
    # waits outside the worker instead.
    def elsewhere(decision: Decision) -> bool:
        return not isinstance(admission.refused(known, decision), admission.Sleep)

    def check(decision: Decision) -> None:
        action = admission.refused(known, decision)
        if isinstance(action, (Drop, TimeOut)):
            _end(task, action)

    def ask(step: waiting.Ask) -> Decision:
        if step.late:
            logger.info("throttle: task %s[%s] ready %.3fs after its slot; asking again",
                        task.name, request.id, step.late)
        decision = runtime.gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                             grace=step.grace, holder=holder,
                                             in_line=step.in_line, near=step.near)
        if step.claim is not None and step.claim.booked and not decision.allowed \
                and not decision.early:
            # Arrived after its start's grace, or a limit it was not booked in is busy:
            # the start is lost (a little throughput) rather than used late (that
            # could burst).
            logger.info("throttle: task %s[%s] lost its slot (%.3fs ago); asking again",
                        task.name, request.id, from_us(decision.now - step.claim.slot))
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
                         claim=state.claim_under(limits), elsewhere=elsewhere, check=check,
                         max_sleeps=_MAX_SLEEPS)
    try:
        outcome = waiting.drive(steps, ask, sleep, give_back)
    except redis.RedisError as exc:
        metrics.store_error([lim.name for lim in limits])
        _store_failed(task, runtime, state, exc)
        return False
    action = admission.settled(known, outcome)
    if isinstance(action, Start):
        run.late = max(0.0, action.late)
        return True
    if isinstance(action, JoinLine):
        if action.booking is not None:
            with contextlib.suppress(redis.RedisError):
                runtime.gate.cancel(limits, action.booking)
        _join_line(task, runtime, limits, outcome.decision, action, state, known)
        # (still here: the store failed as it joined)
        action = admission.unlined(known, outcome.decision)
    _wait_counted_down(task, runtime, limits, state, outcome.decision, action)


def _wait_counted_down(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
                       state: WaitState, decision: Decision, action: CountDown) -> NoReturn:
    """The task waits out of the process as a countdown (the room is closed for it, or it
    could not be put in line): re-published to come back for ``action``'s booking, or to
    when a start is within reach."""
    booking = action.booking
    new = WaitState(slot=booking.slot if booking else None,
                    booked=booking.booked if booking else 0,
                    epoch=booking.epoch if booking else 0,
                    shift=booking.shift if booking else 0, deferrals=state.deferrals + 1,
                    since=state.since or decision.now, copy=new_copy(), prev=state.copy_id,
                    spacing=spacing_of(limits))
    new = _count_down(task, runtime, new, action.seconds)
    write_note(task, runtime, wait_note(task, action.limit, decision, new), action.wait)
    if getattr(task, "acks_late", False):
        _move_pointer(task, runtime, state, new.copy)
    metrics.deferred(action.limit, action.wait)
    announce(task, limit=action.limit, wait=action.wait, deferrals=new.deferrals,
             reason="limit")
    logger.info("throttle: task %s[%s] waits %.3fs for limit %r (deferral %d)",
                task.name, task.request.id, action.wait, action.limit, new.deferrals)
    raise Ignore()


def _room_open(task: Task[Any, Any], runtime: Runtime) -> bool:
    """The waiting room is on, this app's workers run dispatchers (it was installed), and
    the store keeps a waiting task as well as the broker would (``room/durability.py``)."""
    return (runtime.config.waiting_room and getattr(task.app, INSTALLED, False)
            and runtime.durability.safe())


def _kept(runtime: Runtime) -> bool:
    """Is a task that starts to wait now also kept beside the broker's queues
    (``room/keeper.py``: the store alone would lose it)?"""
    return runtime.room.keeper is not None and runtime.durability.verdict().kept


def _handed_out_within(runtime: Runtime) -> float:
    """How far ahead of its start the line hands a task out (seconds; ``queues.ahead``)."""
    try:
        return runtime.room.queues.ahead(to_us(runtime.config.dispatch_lead))
    except redis.RedisError:
        return runtime.config.max_sleep  # (the decision meets the store's failure next)


def _rank(task: Task[Any, Any], runtime: Runtime) -> int:
    """The task's priority as a rank, 0 first, in the order its broker delivers them.

    kombu's Redis transport (and the other virtual ones) delivers 0 first and
    counts a message without a priority as 0; AMQP brokers deliver a higher
    number first and count none as 0, the lowest.  Celery's range is 0-9.
    """
    raw = (task.request.delivery_info or {}).get("priority")
    priority = min(max(raw, 0), 9) if isinstance(raw, int) else 0
    return 9 - priority if runtime.config.high_priority_first else priority


def _join_line(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
               decision: Decision, line: JoinLine, state: WaitState, known: Known) -> None:
    """Wait in the line of the limit that blocks the task (``line.limit``), then raise
    ``Ignore``.

    Returns (the caller re-publishes it) if it cannot be put in line: the
    store failed.  Its place: its first wait plus its rank's ageing steps.
    """
    request = task.request
    if getattr(task, "acks_late", False):
        _refuse_superseded(task, runtime, state)
    blocking = line.limit
    since = state.since or decision.now
    seats = [lim for lim in limits if isinstance(lim, Concurrency)]
    if seats:
        # A seat it may hold (taken for a turn it came too late for) is not kept
        # idle while it waits: the next in line for one gets it.
        with contextlib.suppress(redis.RedisError):
            runtime.gate.release(seats, str(request.id))
    new, entry = _next_in_line(task, state, since, limits)
    kept = _kept(runtime)
    headers = {**(request.headers or {}),
               HEADER: replace(new, entry=entry, kept=kept).to_header()}
    envelope = capture(task.signature_from_request(request, headers=headers))
    due = decision.now + to_us(decision.retry_after)
    try:
        waiting = runtime.room.enqueue(
            entry, envelope.dumps(), str(request.id),
            **_line_args(task, runtime, limits, blocking, since, decision.now, known.to_expiry,
                         known.max_wait),
            due_us=0 if decision.queued or isinstance(blocking, Concurrency) else due,
            kept=kept)
    except redis.RedisError as exc:
        metrics.store_error(["(waiting room)"])
        _log_outage(runtime, exc, "re-published with a countdown instead of put in line")
        return
    if not waiting:
        _drop(task, Drop("delivered again"))
    _waits_in_line(task, runtime, state, new, blocking, line.wait)
    raise Ignore()


def join_line_on_arrival(task: Task[Any, Any], runtime: Runtime, limits: list[Limit],
                         max_wait: float | None, message: Any, now_us: int) -> bool:
    """A fresh message of ``task`` (``task.request`` is its context) whose first limit has
    tasks in line: put it behind them, as it is, before a pool process runs it
    (``arrival.py``).  True when it waits in line (or waited already: the broker delivered
    it again); False when that line is empty or it has expired (nothing written: the pool
    gates it).  ``now_us``: the store's clock now, as near as the caller knows it.
    Raises ``redis.RedisError`` when the store fails (nothing is acknowledged: the pool
    gates it under the store-down policy).
    """
    request = task.request
    runtime.counts.start()  # (once per process) as admit(): the dashboard's history
    to_expiry = _seconds_to_expiry(request)
    if not _room_open(task, runtime) or (to_expiry is not None and to_expiry <= 0):
        return False
    state = WaitState()
    blocking = limits[0]
    new, entry = _next_in_line(task, state, now_us, list(limits))
    kept = _kept(runtime)
    envelope = Envelope.of_message(
        message, {HEADER: replace(new, entry=entry, kept=kept).to_header()})
    ahead = runtime.room.enqueue(
        entry, envelope.dumps(), str(request.id),
        **_line_args(task, runtime, list(limits), blocking, now_us, now_us, to_expiry, max_wait),
        behind=True, kept=kept)
    if ahead < 0:
        return False
    if ahead == 0:
        logger.info("throttle: task %s[%s] dropped: its message was delivered again while it "
                    "waits (the copy waiting goes on)", task.name, request.id)
        return True
    _waits_in_line(task, runtime, state, new, blocking,
                   from_us(ahead * blocking.cost * blocking.rate.interval_us))
    return True


def _place(task: Task[Any, Any], runtime: Runtime, since: int) -> int:
    """A waiting task's place (us) in a limit's queue: when it first waited (``since``,
    server clock) plus its priority's rank times the ageing step, so rank 0 goes first and
    the others age toward it."""
    return since + _rank(task, runtime) * to_us(runtime.config.priority_ageing)


def _next_in_line(task: Task[Any, Any], state: WaitState, since: int,
                  limits: list[AnyLimit]) -> tuple[WaitState, str]:
    """The state of the task's copy that waits in line, and its entry there."""
    new = WaitState(deferrals=state.deferrals + 1, since=since, copy=new_copy(),
                    prev=state.copy_id, spacing=spacing_of(limits))
    return new, _entry_of(task, new.prev)


def _line_args(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
               blocking: AnyLimit, since: int, now: int, to_expiry: float | None,
               max_wait: float | None) -> dict[str, Any]:
    """Where the task waits in line: its place (its first wait plus its rank's ageing
    steps), its expiry and its ``max_wait`` deadline (server clock, us)."""
    config = runtime.config
    return {"limits": limits, "blocking": blocking,
            "place_us": _place(task, runtime, since),
            "expires_us": now + to_us(max(to_expiry, 0.0)) if to_expiry is not None else 0,
            "deadline_us": since + to_us(max_wait) if max_wait is not None else 0,
            "weights": config.fair_weights}


def _waits_in_line(task: Task[Any, Any], runtime: Runtime, state: WaitState, new: WaitState,
                   blocking: AnyLimit, wait: float) -> None:
    """The task waits in ``blocking``'s line as ``new`` (about ``wait`` seconds): say so."""
    if getattr(task, "acks_late", False):
        _move_pointer(task, runtime, state, new.copy)
    metrics.deferred(blocking.name, wait)
    announce(task, limit=blocking.name, wait=wait, deferrals=new.deferrals, reason="limit")
    logger.info("throttle: task %s[%s] waits in line for limit %r (~%.3fs; deferral %d)",
                task.name, task.request.id, blocking.name, wait, new.deferrals)


def _seats_kept(task: Task[Any, Any], runtime: Runtime, concurrent: list[Concurrency],
                holder: str, state: WaitState) -> bool:
    """A task dispatched from its line with seats taken for it: are they still its own?

    The seats were taken at dispatch for a lease's time, renewed by nobody
    while the copy travels.  A copy that comes later than that (its node was
    killed and the broker restored it after its visibility timeout) may find
    them given to the next in line: it takes a free one again, or asks again.
    """
    if not concurrent:
        return True
    try:
        lost = runtime.gate.extend(concurrent, holder)
    except redis.RedisError as exc:
        metrics.store_error([lim.name for lim in concurrent])
        _store_failed(task, runtime, state, exc)
        return True  # (policy "allow")
    if lost:
        logger.info("throttle: task %s[%s] arrived after its seat was given to another; "
                    "asking again", task.name, task.request.id)
    return not lost


def _turn_kept(task: Task[Any, Any], run: Run, limits: list[AnyLimit],
               state: WaitState, arrived_at: int | None, asked: float) -> bool:
    """A task dispatched from its queue: wait for the start it was charged for; in time?

    It arrives ahead of that moment by at most the dispatch's lead
    (``queues.MAX_AHEAD_US``) and sleeps until then.  Later than the grace
    (``_grace``), arriving late or woken late (a loaded machine, a container
    out of its CPU quota, can run a sleeping process 100 ms after its
    timer), starting would put two starts closer than an interval (the next
    task keeps its own moment): its turn is lost (a little throughput) and
    it asks again, in line, keeping its place.  The check comes after the
    sleep: the server's clock now is at most its time at the arrival plus
    what this process's clock counted since it asked (``asked``, monotonic).
    """
    if not state.slot or not arrived_at or not any(isinstance(lim, Limit) for lim in limits):
        return True  # (a seat alone: its lease is taken already, lateness spends nothing)
    late = _slept_to_start(task, asked, min(from_us(state.slot - arrived_at),
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
    its start plus the grace ``_turn_kept`` allowed it (the same start, rechecked in the
    last store call before it starts)."""
    if not state.slot or not any(isinstance(lim, Limit) for lim in limits):
        return 0
    return state.slot + to_us(_turn_grace(runtime, limits))


def _slept_to_start(task: Task[Any, Any], asked: float, ahead: float) -> float:
    """Sleep until a start ``ahead`` seconds after the moment this process asked for it
    (``asked``, its monotonic clock); how late it woke (``waiting.late_by``: seconds; a
    start already past, ``ahead`` < 0, counts too).  The caller tells a late start from
    a timely one by the grace (``_grace``)."""
    if ahead > 0:
        time.sleep(ahead)
    faults.at("defer.start_slept", task)
    return waiting.late_by(asked, ahead)


def _entry_of(task: Task[Any, Any], copy: str) -> str:
    """The waiting room's entry of the task's message copy ``copy`` (``queues.entry_id``):
    a broker that delivers that copy again (a node's warm shutdown gives back messages
    whose acknowledgement it had not sent yet) finds it waiting already."""
    return entry_id(str(task.request.id), copy)


def _waited(runtime: Runtime, state: WaitState) -> float:
    """Seconds since the task first waited (0 if unknown or the store is down)."""
    if not state.since:
        return 0.0
    try:
        sec, usec = runtime.gate.client.time()
    except redis.RedisError:
        return 0.0
    return max(0.0, from_us(int(sec) * 1_000_000 + int(usec) - state.since))


def _send_back(task: Task[Any, Any], runtime: Runtime, state: WaitState,
               countdown: float) -> WaitState:
    """A task due again in ``countdown`` seconds, uncharged (a provider's pause), leaves the
    worker: parked in the waiting room's timer (:func:`_park`) where it is open, else
    re-published with a countdown (:func:`_count_down`).  Returns the copy sent."""
    if _park(task, runtime, state, to_us(max(countdown, 0.0))):
        return state
    return _count_down(task, runtime, state, countdown)


def _count_down(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                countdown: float) -> WaitState:
    """Re-publish the task with ``countdown``, at most ``throttle_max_countdown`` (a longer
    wait comes back then and asks again); return the copy the broker took.

    A copy booked for a slot is aimed the dispatch lead before it, as the
    waiting room dispatches one: aimed at the slot itself, its way to a pool
    process (the broker's delivery, the consumer, the pool's handoff) would
    make it late, past its grace, and it would lose the slot.  The pool
    process it reaches sleeps the rest.
    """
    config = runtime.config
    if state.booked and countdown <= config.max_countdown:
        countdown -= min(config.dispatch_lead, countdown)
    return _republish(task, state, min(max(countdown, 0.001), config.max_countdown))


def _park(task: Task[Any, Any], runtime: Runtime, state: WaitState, delay_us: int) -> bool:
    """Park the task in the waiting room's timer, due ``delay_us`` from now.

    False when it cannot be parked (the waiting room is off, the app was
    never installed so no worker dispatches it, or the store failed): the
    caller re-publishes it with a countdown instead, never losing it.
    """
    if not _room_open(task, runtime):
        return False
    request = task.request
    entry = _entry_of(task, state.prev)
    kept = _kept(runtime)
    headers = {**(request.headers or {}),
               HEADER: replace(state, entry=entry, kept=kept).to_header()}
    envelope = capture(task.signature_from_request(request, headers=headers))
    try:
        at = runtime.room.park(entry, envelope.dumps(), str(request.id), delay_us=delay_us,
                               kept=kept)
    except redis.RedisError as exc:
        metrics.store_error(["(waiting room)"])
        _log_outage(runtime, exc, "re-published with a countdown instead of parked")
        return False
    if not at:
        _drop(task, Drop("delivered again"))
    return True


def _first_arrival(task: Task[Any, Any], runtime: Runtime, state: WaitState) -> int | None:
    """A copy dispatched from the waiting room: is it the first of its entry to arrive?

    None: no; else the server's time (us; 0 when the store is down).  With
    the store down this is the store-down policy's call (``defer``
    re-publishes the copy, still naming its entry, so exactly one copy of
    the entry goes on once the store is back).
    """
    acks_late = getattr(task, "acks_late", False)
    # acks_late: the broker may redeliver this copy after a crash mid-run,
    # as late as its visibility timeout; the marker must outlive that.
    ttl_ms = int(runtime.config.visibility_timeout * 1000) + 60_000 if acks_late else 0
    try:
        now = runtime.room.arrive(state.entry, state.token, state.room, marker_ttl_ms=ttl_ms,
                                  task_id=str(task.request.id), note_ttl_ms=NOTE_AFTER_MS,
                                  kept=state.kept, held_us=state.held)
    except redis.RedisError as exc:
        metrics.store_error(["(waiting room)"])
        _store_failed(task, runtime, state, exc)
        return 0  # policy "allow"
    return now or None


def _move_pointer(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                  then: str, *, latest_us: int = 0) -> Verdict:
    """acks_late: may this copy go on (``CopyPointer.move``)?  Store down: yes.

    With the store down a copy re-published meanwhile names this one as its
    predecessor, so the pointer still lets exactly one through; a start with
    the store down is the store-down policy's call.
    """
    request = task.request
    try:
        return runtime.copies.move(str(request.id), request.retries, state, then,
                                   latest_us=latest_us)
    except redis.RedisError as exc:
        if then == "ran:":
            _store_failed(task, runtime, state, exc)
        return "go"


def _refuse_superseded(task: Task[Any, Any], runtime: Runtime, state: WaitState) -> None:
    """acks_late: is this copy still the task's, before it gives back the seats held under
    the task's id and puts the task in line?  A copy delivered again after it was
    re-published is not: those seats may be its newer copy's, and a second copy of the
    task in line would be refused when served, with its kept copy left behind.

    Only asked, nothing moved: the pointer moves after the task is in line, so a
    node dying in between leaves this copy (redelivered) to go on.  Store down:
    the move after decides, as ``_move_pointer``.
    """
    request = task.request
    try:
        verdict = runtime.copies.check(str(request.id), request.retries, state)
    except redis.RedisError:
        return
    refused = admission.verdict(verdict)
    if refused is not None:
        _drop(task, refused)


def _republish(task: Task[Any, Any], state: WaitState, countdown: float) -> WaitState:
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
    request = task.request
    app = task.app
    sent: list[WaitState] = []
    asked = time.monotonic()

    def attempt(producer: Any) -> None:
        this = replace(state, copy=new_copy()) if sent else state
        sent.append(this)
        headers = {**(request.headers or {}), HEADER: this.to_header()}
        # Counted from now, not from the publish: a publish that takes long (a new
        # connection, the ladder's declaration, a retry) must not make it late.
        left = max(countdown - (time.monotonic() - asked), 0.001)
        # signature_from_request keeps id, args, queue/routing, priority, links,
        # chain, expires, time limits and `retries` (so max_retries is untouched).
        # Captured, then published as captured: apply_async itself would have the
        # result backend subscribe to its result where joins do not block (see
        # capture()), once per re-publish.
        if ladder is None:  # (a Redis broker: an ETA, held by the worker it reaches)
            envelope = by_lane(capture(task.signature_from_request(
                request, countdown=left, headers=headers)))
            envelope.publish(producer, queues=app.amqp.queues, retry=False)
        else:  # RabbitMQ: it waits in the broker, on the delay ladder
            envelope = by_lane(capture(task.signature_from_request(request, headers=headers)))
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
    merged["max_retries"] = max(int(merged.get("max_retries") or 0),
                                int(_REPUBLISH_RETRY["max_retries"]))
    merged["interval_max"] = max(float(merged.get("interval_max") or 0.0),
                                 float(_REPUBLISH_RETRY["interval_max"]))
    return merged


def _store_failed(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                  exc: redis.RedisError) -> None:
    """The store failed while the task was decided: returns when the store-down policy
    lets it run unthrottled; otherwise it fails, or waits for the store (a countdown)."""
    policy = runtime.config.on_error
    _log_outage(runtime, exc, f"policy {policy!r}")
    action = admission.store_down(policy, state.deferrals, random.uniform(0.5, 1.0))
    if isinstance(action, Start):
        return
    if isinstance(action, admission.StoreFailed):
        raise ThrottleStoreError(f"throttle store unavailable for task {task.name!r}: "
                                 f"{type(exc).__name__}") from exc
    new = state.unmoved_successor(new_copy())
    # The copy pointer is not moved (the store is down): the new copy names
    # the last copy the pointer knows as its predecessor, which it accepts.
    # (No THROTTLED state here: a result backend on the store's server is down
    # too, and Celery's Redis backend retries a write for about 20 s.)
    _count_down(task, runtime, new, action.seconds)
    logger.info("throttle: task %s[%s] re-scheduled in %.1fs: store unavailable (deferral %d)",
                task.name, task.request.id, action.seconds, new.deferrals)
    raise Ignore()


def _end(task: Task[Any, Any], action: Drop | TimeOut) -> NoReturn:
    """The task ends here: dropped, or failed with its ``max_wait`` passed."""
    if isinstance(action, Drop):
        _drop(task, action)
    raise ThrottleTimeout.exceeded(task.name, action.limit, action.waited, action.max_wait)


_DROPPED = {
    "second copy": "a second copy dispatched from the waiting room (the first one goes on)",
    "delivered again": "its message was delivered again while it waits (the copy waiting "
                       "goes on)",
    "ended": "its run has ended (its message was delivered again)",
    "stale": "a stale copy (a node died while re-scheduling it; its newer copy goes on)",
}


def _drop(task: Task[Any, Any], drop: Drop) -> NoReturn:
    """The task's copy ends here, never run.  A copy the pointer refused keeps the seats
    held under the task's id (while the task runs or waits they are its running or newer
    copy's); an expired task is marked revoked, as Celery marks one."""
    request = task.request
    if drop.reason == "expired":
        logger.info("throttle: task %s[%s] expires before its slot (%.3fs away); not run",
                    task.name, request.id, drop.away)
        task.backend.mark_as_revoked(str(request.id), "expired", request=request)
    elif drop.reason in ("ended", "stale"):
        logger.warning("throttle: task %s[%s] dropped: %s", task.name, request.id,
                       _DROPPED[drop.reason])
    else:
        logger.info("throttle: task %s[%s] dropped: %s", task.name, request.id,
                    _DROPPED[drop.reason])
    raise Ignore()

def _log_outage(runtime: Runtime, exc: redis.RedisError, what: str) -> None:
    """Report the store being down once per 30 s per process and app, not per task."""
    # It may come back with another configuration: ask again before parking there.
    runtime.durability.invalidate()
    if runtime.outage.due():
        # The exception's text names host and port, never the password.
        logger.warning("throttle: store unavailable (%s: %s); %s", type(exc).__name__, exc,
                       what)
