"""A task waits in its limit's line (``room/lines.py``): where it stands and how it gets there.

Two ways in: a running copy the gate refuses for longer than it may sleep
(:func:`join_line`, from ``act.py``), and a fresh message whose limit has
tasks in line already, put behind them in the worker's main process before a
pool process takes it (:func:`join_line_on_arrival`, from ``arrival.py``).
Its place is when it first waited plus its priority's ageing steps; the
dispatcher hands it out from there (``room/dispatcher.py``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import redis
from celery import Task

from ..core.limits import AnyLimit, Concurrency, Decision, Limit, seats_of
from ..room.envelope import Envelope
from ..room.header import HEADER, WaitState
from ..room.lines import Behind
from ..values import from_us, to_us
from .admission import CountDown, Drop, JoinLine, Known, booking_horizon, unlined
from .copies import new_copy
from .exits import (
    copy_of,
    entry_of,
    kept_beside_broker,
    pointed_copy,
    refuse_superseded,
    room_open,
    room_write_failed,
    say_dropped,
    seconds_to_expiry,
    waits_in_line,
)
from .runtime import Runtime
from .waiter import Waiter

__all__ = ["NOT_LINED", "handed_out_within", "in_line_horizon", "join_line",
           "join_line_on_arrival"]

#: A task not lined up as it arrived (the pool gates it).
NOT_LINED = Behind(-1, 0)


def join_line(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
              decision: Decision, line: JoinLine, state: WaitState, known: Known
              ) -> Drop | CountDown | None:
    """Wait in the line of the limit that blocks the task (``line.limit``): None once it
    waits there (its copy may leave).  Its place: its first wait plus its rank's ageing
    steps.

    Where it cannot: a :class:`CountDown` when the store failed as it joined (it
    is re-published instead, nothing booked: ``admission.unlined``), a
    :class:`Drop` when it is not the task's copy any more, or the line has this
    copy already (its message was delivered again).
    """
    request = task.request
    if line.booking is not None:  # (the line serves it from now on)
        with contextlib.suppress(redis.RedisError):
            runtime.gate.cancel(limits, line.booking)
    if pointed_copy(task, state):
        superseded = refuse_superseded(task, runtime, state)
        if superseded is not None:
            return superseded
    blocking = line.limit
    since = state.since or decision.now
    seats = seats_of(limits)
    if seats:
        # A seat it may hold (taken for a turn it came too late for) is not kept
        # idle while it waits: the next in line for one gets it.
        with contextlib.suppress(redis.RedisError):
            runtime.gate.release(seats, str(request.id))
    waiter = Waiter.of_run(task)
    new, entry = _next_in_line(waiter, state, since, limits)
    kept = kept_beside_broker(runtime)
    envelope = copy_of(task, replace(new, entry=entry, kept=kept))
    due = decision.now + to_us(decision.retry_after)
    try:
        waiting = runtime.room.enqueue(
            entry, envelope.dumps(), str(request.id),
            **_line_args(waiter, runtime, limits, blocking, since, decision.now, known.to_expiry,
                         known.max_wait),
            due_us=0 if decision.queued or isinstance(blocking, Concurrency) else due,
            kept=kept)
    except redis.RedisError as exc:
        room_write_failed(runtime, exc, "re-published with a countdown instead of put in line")
        return unlined(known, decision)
    if not waiting:
        return Drop("delivered again")
    waits_in_line(waiter, runtime, state, new, blocking, line.wait)
    return None


def join_line_on_arrival(waiter: Waiter, runtime: Runtime, limits: list[AnyLimit],
                         max_wait: float | None, message: Any, now_us: int) -> Behind:
    """A fresh message (``waiter``, read from it in the worker's main process) whose first
    limit is a rate limit: put it in that limit's line, as it is, before a pool process
    runs it (``arrival.py``), if it would wait there: behind the tasks in line, or, the line
    empty, when the limit admits no start within the booking horizon (a pool process
    would put it in line then).  Its other limits (rates, seats) are taken when its
    turn comes, as for a task a pool process put in line.  Returns where it stands
    (``Behind``): ``ahead`` -1 when it would not wait or has expired (nothing written:
    the pool gates it).  ``now_us``: the store's clock now, as near as the caller knows
    it.  Raises ``redis.RedisError`` when the store fails (nothing is acknowledged: the
    pool gates it under the store-down policy).
    """
    runtime.counts.start()  # (once per process) as admit(): the dashboard's history
    to_expiry = seconds_to_expiry(waiter.expires)
    if not room_open(waiter.task, runtime) or (to_expiry is not None and to_expiry <= 0):
        return NOT_LINED
    state = WaitState()
    blocking = limits[0]
    if not isinstance(blocking, Limit):
        raise TypeError(f"the first limit must be a rate limit, not {type(blocking).__name__}")
    within = booking_horizon(in_line_horizon(runtime), to_expiry, max_wait)
    new, entry = _next_in_line(waiter, state, now_us, list(limits))
    kept = kept_beside_broker(runtime)
    envelope = Envelope.of_message(
        message, {HEADER: replace(new, entry=entry, kept=kept).to_header()})
    behind = runtime.room.line_up(
        entry, envelope.dumps(), waiter.id,
        **_line_args(waiter, runtime, list(limits), blocking, now_us, now_us, to_expiry,
                     max_wait),
        within_us=to_us(within), kept=kept, patient=False)  # (the consumer's thread)
    if behind.ahead == -1:
        return behind
    if behind.ahead == -2:  # (nothing to end here: the main process acknowledges the message)
        say_dropped(waiter, Drop("delivered again"))
        return behind
    waits_in_line(waiter, runtime, state, new, blocking,
                  from_us(behind.ahead * blocking.cost * blocking.rate.interval_us
                          + behind.wait_us))
    return behind


def in_line_horizon(runtime: Runtime) -> float:
    """How far ahead a start may be booked where a task would wait in line (seconds;
    before its expiry and ``max_wait``): only a start the line would hand out now (a
    later one waits in line, unbooked, where turns and priorities order it)."""
    config = runtime.config
    return booking_horizon(config.horizon, None, None,
                           min(config.max_sleep, handed_out_within(runtime)))


def handed_out_within(runtime: Runtime) -> float:
    """How far ahead of its start the line hands a task out (seconds; ``lines.ahead``)."""
    try:
        return runtime.room.lines.ahead(to_us(runtime.config.dispatch_lead))
    except redis.RedisError:
        return runtime.config.max_sleep  # (the decision meets the store's failure next)


def _rank(waiter: Waiter, runtime: Runtime) -> int:
    """The task's priority as a rank, 0 first, in the order its broker delivers them.

    kombu's Redis transport (and the other virtual ones) delivers 0 first and
    counts a message without a priority as 0; AMQP brokers deliver a higher
    number first and count none as 0, the lowest.  Celery's range is 0-9.
    """
    raw = waiter.priority
    priority = min(max(raw, 0), 9) if raw is not None else 0
    return 9 - priority if runtime.config.high_priority_first else priority


def _place(waiter: Waiter, runtime: Runtime, since: int) -> int:
    """A waiting task's place (us) in a limit's line: when it first waited (``since``,
    server clock) plus its priority's rank times the ageing step, so rank 0 goes first and
    the others age toward it."""
    return since + _rank(waiter, runtime) * to_us(runtime.config.priority_ageing)


def _next_in_line(waiter: Waiter, state: WaitState, since: int,
                  limits: list[AnyLimit]) -> tuple[WaitState, str]:
    """The state of the task's copy that waits in line, and its entry there."""
    new = state.successor(new_copy(), limits, since)
    return new, entry_of(waiter.id, new.prev)


def _line_args(waiter: Waiter, runtime: Runtime, limits: list[AnyLimit],
               blocking: AnyLimit, since: int, now: int, to_expiry: float | None,
               max_wait: float | None) -> dict[str, Any]:
    """Where the task waits in line: its place (its first wait plus its rank's ageing
    steps), its expiry and its ``max_wait`` deadline (server clock, us)."""
    config = runtime.config
    return {"limits": limits, "blocking": blocking,
            "place_us": _place(waiter, runtime, since),
            "expires_us": now + to_us(max(to_expiry, 0.0)) if to_expiry is not None else 0,
            "deadline_us": since + to_us(max_wait) if max_wait is not None else 0,
            "weights": config.fair_weights}
