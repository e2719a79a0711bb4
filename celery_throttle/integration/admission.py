"""Where a task waits, decided from what is known: no Celery, no store, no clock.

``defer.py`` asks the gate and returns what is decided here, which ``act.py``
carries out (``line.py`` and ``exits.py`` the ways a task leaves the worker);
this module only chooses.
Each function takes what is known about the task (:class:`Known`) and the
gate's answer, and returns one action:

* :class:`Start`: start now (admitted by the gate, or let through by the
  store-down policy ``"allow"``, holding nothing);
* :class:`Sleep`: sleep in the process for a start booked close by, then claim it;
* :class:`JoinLine`: wait in the line of the limit that blocks it (the waiting
  room is open for it);
* :class:`CountDown`: leave the worker and come back after a countdown (the room
  is closed for it), to the start it booked or to when one comes within reach;
* :class:`Drop`: end here, never run (expired before its start, a second copy of
  one entry, a copy the copy pointer refused);
* :class:`TimeOut`: its ``max_wait`` would pass;
* :class:`WaitForStore`: the store is down and the policy is ``"defer"``: come back
  after a backoff; :class:`StoreFailed`: the policy is ``"fail"``;
* :class:`Away`: the copy has left the worker (it waits elsewhere, or was
  dropped): its run ends.

``act.carry_out`` does what is decided, the one function that ends a run.

``core/waiting.py``'s plan stays the core's loop for a caller that waits in
place (``Gate.wait``); a task's plan asks :func:`refused` which waits it sleeps
in the process, and :func:`settled` where the task goes once the plan ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..core.limits import AnyLimit, Concurrency, Decision, Limit, Reservation
from ..core.waiting import Outcome
from ..values import from_us

__all__ = ["Action", "Away", "CountDown", "Drop", "JoinLine", "Known", "Sleep", "Start",
           "StoreFailed", "TimeOut", "WaitForStore", "arrived", "backoff", "booking_horizon",
           "grace", "limit_name", "longest_sleep", "refused", "settled", "store_down", "turn",
           "unlined", "verdict"]

_GRACE_FLOOR, _GRACE_CAP = 0.02, 0.25
_BACKOFF_CAP = 30.0  # the store-down backoff's longest (seconds)


@dataclass(frozen=True, slots=True)
class Known:
    """What is known about a task when its wait is decided.

    ``since``: when it first waited (server clock, us; 0: it had not).
    ``in_line``: a long wait waits in line (the waiting room is open for it), not as
    a countdown.  ``max_sleep``: the longest wait slept in the process
    (:func:`longest_sleep`).  ``horizon``: no start further ahead is booked
    (:func:`booking_horizon`).  ``shortest``: the shortest countdown for a start not
    booked yet (``throttle_max_sleep``: a shorter one would only come back to sleep).
    """

    limits: Sequence[AnyLimit]
    max_sleep: float
    horizon: float
    shortest: float
    to_expiry: float | None = None
    max_wait: float | None = None
    since: int = 0
    in_line: bool = False


@dataclass(frozen=True, slots=True)
class Start:
    """Start now.  ``late``: how long after the start it was admitted for (seconds);
    ``held``: admitted by the gate (its limits charged, its seats held), not by the
    store-down policy."""

    late: float = 0.0
    held: bool = True


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep ``seconds`` in the process, then claim the start booked for then."""

    seconds: float


@dataclass(frozen=True, slots=True)
class JoinLine:
    """Wait in ``limit``'s line, about ``wait`` seconds; ``booking``: a start booked
    before, given back first (the line serves the task from now on)."""

    limit: AnyLimit
    wait: float
    booking: Reservation | None = None


@dataclass(frozen=True, slots=True)
class CountDown:
    """Come back in ``seconds`` and ask again, to ``booking`` (None: nothing booked)
    or to when a start is within reach; it waits for ``limit`` about ``wait`` seconds."""

    seconds: float
    limit: str
    wait: float
    booking: Reservation | None = None


@dataclass(frozen=True, slots=True)
class Drop:
    """End here, never run: ``reason`` says why (the logs and the result say it);
    ``away``: how far its start was when it expired (seconds)."""

    reason: Literal["expired", "second copy", "delivered again", "ended", "stale", "running"]
    away: float = 0.0


@dataclass(frozen=True, slots=True)
class TimeOut:
    """Its ``max_wait`` would pass waiting ``waited`` seconds for ``limit``."""

    limit: str
    waited: float
    max_wait: float


@dataclass(frozen=True, slots=True)
class WaitForStore:
    """The store is down (policy ``"defer"``): come back in ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class StoreFailed:
    """The store is down (policy ``"fail"``): the task fails with the store's error
    (``error``: its kind; ``cause``: the error itself, where known)."""

    error: str = ""
    cause: Exception | None = None


@dataclass(frozen=True, slots=True)
class Away:
    """The copy has left the worker (it waits elsewhere, or was dropped): its run ends."""


Action = Start | Sleep | JoinLine | CountDown | Drop | TimeOut | WaitForStore | StoreFailed \
    | Away


def grace(limits: Sequence[AnyLimit], booked: int, configured: float | None = None) -> float:
    """How late a task may start in its booked start (``booked``: the limits it is booked
    in, bit i for ``limits[i]``; none: all the rate limits).

    Up to half the start's length (cost x interval of the limits it is booked
    in), a late start can add at most one start to a window: the documented
    jitter allowance.  The floor keeps claims possible at high rates, where
    Celery's own ETA jitter (a few ms) exceeds the interval; without it a task
    would lose every start and never run.  The cap bounds the wait for slow
    limits, where a 250 ms late start is harmless.  ``configured``:
    ``throttle_claim_grace``, which overrides all this when set.
    """
    if configured is not None:
        return configured
    rates = [(i, lim) for i, lim in enumerate(limits) if isinstance(lim, Limit)]
    chosen = [lim for i, lim in rates if booked >> i & 1] or [lim for _, lim in rates]
    longest = max((lim.cost * lim.rate.interval for lim in chosen), default=0.0)
    return min(_GRACE_CAP, max(_GRACE_FLOOR, longest / 2))


def booking_horizon(horizon: float, to_expiry: float | None, max_wait: float | None,
                    line_ahead: float | None = None) -> float:
    """How far ahead a task's start may be booked: ``throttle_horizon``, but no start it
    could not use (past its expiry or its ``max_wait``), and, where it would wait in line
    (``line_ahead``: how far ahead the line hands a task out), only a start the line
    would hand out now: a later one waits in line, unbooked, where turns and priorities
    order it (a longer horizon would let the processes' sleeps hold a fast limit's
    backlog in the broker's order)."""
    if to_expiry is not None:
        horizon = min(horizon, max(0.0, to_expiry))
    if max_wait is not None:
        horizon = min(horizon, max_wait)
    if line_ahead is not None:
        horizon = min(horizon, line_ahead)
    return horizon


def longest_sleep(max_sleep: float, dispatch_lead: float, sent_for_a_start: bool) -> float:
    """The longest wait a task sleeps in the process.  A copy sent for a start (dispatched
    from its line, or re-published for a booked one) arrives up to the dispatch lead
    early: it sleeps that, whatever ``throttle_max_sleep`` says (sending it away again
    for less would loop)."""
    return max(max_sleep, dispatch_lead + 0.1) if sent_for_a_start else max_sleep


def limit_name(decision: Decision, limits: Sequence[AnyLimit]) -> str:
    """The limit a refused task waits for: the one that forced the wait, else the first
    its start is booked in.  (An "early" answer, for a start that moved later, names no
    limit.)"""
    if decision.limit is not None:
        return decision.limit.name
    booked = decision.reservation.booked if decision.reservation is not None else 0
    return next((lim.name for i, lim in enumerate(limits) if booked >> i & 1), "(booked start)")


def _waits_for_a_seat(decision: Decision) -> bool:
    """A wait for a full concurrency limit (its paced return, nothing booked): in the seat's
    line it is served the next freed seat in the line's order; a task sleeping in a worker
    for its paced return would only compete."""
    booking = decision.reservation
    return (isinstance(decision.limit, Concurrency) and booking is not None
            and not booking.booked)


def refused(known: Known, decision: Decision) -> Action:
    """The gate refused the task for now: drop it, time it out, sleep here, or leave.

    Asked for every refusal, before anything is waited: a wait past its expiry
    drops it, past its ``max_wait`` times it out; a start booked within
    ``max_sleep`` (not a seat's paced return, where a line is open) is slept
    here; anything else waits out of the process (:func:`settled`).
    """
    if decision.queued:
        return _leave(known, decision)  # tasks in line: behind them (the line keeps time)
    if known.to_expiry is not None and decision.retry_after > known.to_expiry:
        return Drop("expired", decision.retry_after)
    if known.max_wait is not None:
        waited = from_us(decision.now - known.since) if known.since else 0.0
        if waited + decision.retry_after > known.max_wait:
            return TimeOut(limit_name(decision, known.limits), waited + decision.retry_after,
                           known.max_wait)
    if decision.reservation is None or decision.retry_after > known.max_sleep \
            or (known.in_line and _waits_for_a_seat(decision)):
        return _leave(known, decision)
    return Sleep(decision.retry_after)


def settled(known: Known, outcome: Outcome) -> Start | JoinLine | CountDown | Drop | TimeOut:
    """Where the task goes once its plan in the process ended: it starts; or the refusal
    that ended it (:func:`refused`) drops it or times it out; or the wait left (one too
    long to sleep, or a start lost again and again) waits out of the process."""
    decision = outcome.decision
    if decision.allowed:
        return Start(late=outcome.late)
    action = refused(known, decision)
    if isinstance(action, (Drop, TimeOut, JoinLine, CountDown)):
        return action
    return _leave(known, decision)  # (a sleep left after the plan's last one)


def _leave(known: Known, decision: Decision) -> JoinLine | CountDown:
    booking = decision.reservation
    if known.in_line:
        # Every wait left to wait out of the process waits in line, a booked one too:
        # the booking is given back.  (An early answer names no limit: its start was
        # its rate limits'.)
        blocking = decision.limit if decision.limit is not None else \
            next((lim for lim in known.limits if isinstance(lim, Limit)), known.limits[0])
        return JoinLine(blocking, decision.retry_after,
                        booking if booking is not None and booking.booked else None)
    # A countdown to the start it booked, or, with nothing booked (the wait is beyond
    # the horizon), to when a start comes within reach.
    seconds = decision.retry_after if booking is not None else \
        max(decision.retry_after - known.horizon, known.shortest, 0.001)
    return CountDown(seconds, limit_name(decision, known.limits), decision.retry_after, booking)


def unlined(known: Known, decision: Decision) -> CountDown:
    """A task that could not be put in line (the store failed as it joined): a countdown,
    as if the room were closed for it; the booking was given back."""
    no_booking = Decision(allowed=False, retry_after=decision.retry_after, limit=decision.limit,
                          now=decision.now, early=decision.early)
    closed = Known(known.limits, known.max_sleep, known.horizon, known.shortest,
                   known.to_expiry, known.max_wait, known.since, in_line=False)
    leave = _leave(closed, no_booking)
    assert isinstance(leave, CountDown)
    return leave


def arrived(charged: str, *, first: bool = True, limit: str = "", waited: float = 0.0,
            max_wait: float | None = None) -> Drop | TimeOut | None:
    """A copy arrives.  ``first``: False for a second copy of one entry dispatched from
    the waiting room (the first goes on); ``charged``: how its line served it (``"t"``:
    its ``max_wait`` passed in line, ``waited`` seconds for ``limit``).  None: go on."""
    if not first:
        return Drop("second copy")
    if charged == "t":
        return TimeOut(limit, waited, max_wait or 0.0)
    return None


def turn(late: float, turn_grace: float) -> Start | None:
    """A copy dispatched for its turn (every limit charged for it) sleeps to it and wakes
    ``late`` seconds after it: later than ``turn_grace``, starting would put two starts
    closer than an interval (the next task keeps its own moment), so its turn is lost
    (None: it asks again, in line, keeping its place)."""
    return Start(late=max(0.0, late)) if late <= turn_grace else None


def verdict(pointer: str) -> Drop | None:
    """A copy asked the copy pointer whether it may go on (``copies.py``): ``"go"`` lets it
    on (None), and so does ``"rerun"`` (a run again after a crash: its start was asked
    afresh); ``"ended"`` (the task's run has ended) and ``"running"`` (another copy of
    it has started) drop it, saying so; any refusal else (``"stale"``: a newer copy goes
    on; a second ``"late"``) drops it as a stale copy.  (A first ``"late"`` is the
    caller's: it asks the gate again.)"""
    if pointer in ("go", "rerun"):
        return None
    if pointer == "ended":
        return Drop("ended")
    return Drop("running" if pointer == "running" else "stale")


def backoff(deferrals: int, jitter: float) -> float:
    """How long a task waits for the store to come back: 1, 2, 4 ... 30 s by its deferrals,
    times ``jitter`` (0.5-1.0: a fleet of waiting tasks does not return in step)."""
    return min(_BACKOFF_CAP, 2.0 ** min(deferrals, 5)) * jitter


def store_down(policy: str, deferrals: int, jitter: float) -> Start | StoreFailed | WaitForStore:
    """The store failed while the task was decided: the store-down policy's call
    (``throttle_on_error``): run unthrottled, fail, or come back after a backoff."""
    if policy == "allow":
        return Start(held=False)
    if policy == "fail":
        return StoreFailed()
    return WaitForStore(backoff(deferrals, jitter))
