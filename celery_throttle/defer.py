"""Making an over-limit task wait for its slot: claims, sleeps, countdowns, hops, expiry.

The task is re-published under the same id, queue, routing, headers and
options, with ``retries`` untouched, then the running copy ends with Celery's
``Ignore`` (its message is acknowledged, no result is stored).  What it needs
on the next arrival travels in one message header, :data:`HEADER`.

With ``acks_late`` the old message is acknowledged only after the new one is
published: a node that dies in between leaves both, and the broker redelivers
the old one.  So every re-published message carries a fresh copy id and the
id of the copy that published it, and for an ``acks_late`` task a pointer in
Redis names the one copy that may go on (``lua/copies.lua``): moved to the
successor after each re-publish, and to "started" when a copy starts.  A
copy the pointer does not name is dropped, so exactly one of the two runs.
The copy that started may still run again if its node dies mid-run: that is
``acks_late``'s at-least-once, untouched.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.resources
import json
import logging
import math
import random
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import redis
from celery import Task, signals
from celery.exceptions import Ignore

from . import leases, metrics
from .envelope import capture
from .errors import ThrottleStoreError, ThrottleTimeout
from .gate import AnyLimit, Concurrency, Decision, Limit, Reservation
from .keys import key_digest, task_key
from .releaser import queue_of
from .store import INSTALLED, Runtime

__all__ = ["HEADER", "WaitState", "admit", "defer_after_start", "read_wait"]

logger = logging.getLogger("celery_throttle")

#: The message header carrying a waiting task's state between hops.
HEADER = "celery_throttle"

# The store being down is reported once per this many seconds per process,
# not once per task (hundreds of tasks may be deferred per second).
_OUTAGE_LOG_EVERY = 30.0
_GRACE_FLOOR, _GRACE_CAP = 0.02, 0.25
_MAX_SLEEPS = 3
_STARTED = "_celery_throttle_started"  # request attribute: (runtime, state) of a started copy
_LEASED = "_celery_throttle_leased"  # request attribute: the leases.Held of this run
_last_outage_log = 0.0
_COPIES = importlib.resources.files(__package__).joinpath("lua/copies.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class WaitState:
    """What a deferred message carries: its booked slot, deferral count and first wait."""

    slot: int | None = None  # booked start, server clock, microseconds
    booked: int = 0  # the limits the slot is booked in (Reservation.booked)
    epoch: int = 0  # the store lifetime the slot was booked in (Reservation.epoch)
    deferrals: int = 0
    since: int | None = None  # server clock (us) of the first deferral
    copy: str = ""  # set by every re-publish: tells a duplicate from a redelivery
    prev: str = ""  # the copy that published this one ("-": the user's message)
    spacing: tuple[int, ...] = ()  # each limit's interval (us) when the slot was booked
    entry: str = ""  # the waiting-room entry this copy was released from (waiting_room.py)
    token: str = ""  # the release that published this copy (set by the releaser)
    room: int = 0  # the store's epoch when it was released (set by the releaser)

    @classmethod
    def from_request(cls, request: Any) -> WaitState:
        """Read the state from a task request (Celery >= 5.3 exposes custom headers)."""
        raw = (getattr(request, "headers", None) or {}).get(HEADER)
        if raw is None:
            raw = getattr(request, HEADER, None)
        if not isinstance(raw, dict):
            return cls()
        def num(name: str) -> int:
            value = raw.get(name)
            return value if isinstance(value, int) and value > 0 else 0

        def text(name: str, longest: int = 32) -> str:
            value = raw.get(name)
            return value if isinstance(value, str) and len(value) <= longest else ""

        spacing = raw.get("spacing")
        if not (isinstance(spacing, list) and len(spacing) <= 64
                and all(isinstance(t, int) for t in spacing)):
            spacing = []
        return cls(slot=num("slot") or None, booked=num("booked"), epoch=num("epoch"),
                   deferrals=num("deferrals"), since=num("since") or None, copy=text("copy"),
                   prev=text("prev"), spacing=tuple(spacing), entry=text("entry", 64),
                   token=text("token", 40), room=num("room"))

    @property
    def copy_id(self) -> str:
        """This copy's id as the copy pointer knows it ("-": the message the user sent)."""
        return self.copy or "-"

    @property
    def claim(self) -> Reservation | None:
        """The reservation to claim on arrival, if any."""
        return Reservation(self.slot, self.booked, self.epoch) if self.slot else None

    def claim_under(self, limits: list[AnyLimit]) -> Reservation | None:
        """The booking, unless a limit is now slower than when it was booked.

        Booked slots are spaced at the old interval; honouring them after a
        rate was lowered (workers restarted with a new rate) would run the
        waiting tasks at the old, faster pace.  So they book again.
        """
        now = _spacing(limits)
        if len(now) != len(self.spacing) or any(
                new > old for new, old in zip(now, self.spacing, strict=True)):
            return None
        return self.claim

    def to_header(self) -> dict[str, int | str | list[int] | None]:
        """The header value (JSON-safe)."""
        header: dict[str, int | str | list[int] | None] = {
            "slot": self.slot, "booked": self.booked, "epoch": self.epoch,
            "deferrals": self.deferrals, "since": self.since, "copy": self.copy,
            "prev": self.prev, "spacing": list(self.spacing)}
        if self.entry:
            header.update(entry=self.entry, token=self.token, room=self.room)
        return header


def _spacing(limits: list[AnyLimit]) -> tuple[int, ...]:
    """Each limit's interval (us; 0 for a concurrency limit), carried with a booking."""
    return tuple(lim.rate.interval_us if isinstance(lim, Limit) else 0 for lim in limits)


def _grace(runtime: Runtime, limits: list[AnyLimit], booked_mask: int) -> float:
    """How late a task may start in its booked slot.

    Up to half the slot's length (cost x interval of the limits it is booked
    in), a late start can add at most one start to a window: the documented
    jitter allowance.  The floor keeps claims possible at high rates, where
    Celery's own ETA jitter (a few ms) exceeds the interval; without it a task
    would lose every slot and never start.  The cap bounds the wait for slow
    limits, where a 250 ms late start is harmless.
    """
    if runtime.config.claim_grace is not None:
        return runtime.config.claim_grace
    rates = [(i, lim) for i, lim in enumerate(limits) if isinstance(lim, Limit)]
    booked = [lim for i, lim in rates if booked_mask >> i & 1] or [lim for _, lim in rates]
    longest = max((lim.cost * lim.rate.interval for lim in booked), default=0.0)
    return min(_GRACE_CAP, max(_GRACE_FLOOR, longest / 2))


def _seconds_to_expiry(request: Any) -> float | None:
    expires = getattr(request, "expires", None)
    if not expires:
        return None
    when = expires if isinstance(expires, dt.datetime) else dt.datetime.fromisoformat(expires)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return (when - dt.datetime.now(dt.timezone.utc)).total_seconds()


def admit(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
          max_wait: float | None, estimated: set[str] | None = None) -> None:
    """Return when ``task`` may start now; otherwise re-schedule it and raise ``Ignore``.

    Raises :class:`ThrottleTimeout` past ``max_wait`` and
    :class:`ThrottleStoreError` when the store fails under ``on_error="fail"``.
    Concurrency limits are held under the task's id until its run ends
    (``task_postrun``), renewed meanwhile by this process's heartbeat.
    ``estimated``: names of limits whose cost the task may settle.
    """
    request = task.request
    state = WaitState.from_request(request)
    released = bool(state.entry)
    if released:
        if not _first_arrival(task, runtime, state):
            logger.info("throttle: task %s[%s] dropped: a second copy released from the "
                        "waiting room (the first one goes on)", task.name, request.id)
            raise Ignore()
        # The entry is taken: a copy made from here on is a new one, and goes
        # to the task's queue, not the lane it came by (retry() and parking
        # again take the routing from delivery_info).
        state = replace(state, entry="", token="", room=0)
        info: dict[str, Any] = dict(request.delivery_info or {})
        if info.get("routing_key"):
            info["routing_key"] = queue_of(str(info["routing_key"]))
            request.delivery_info = info  # type: ignore[assignment]
    concurrent = [lim for lim in limits if isinstance(lim, Concurrency)]
    holder = str(request.id) if concurrent else ""
    if _wait_for_slot(task, runtime, limits, max_wait, state, holder, released):
        if concurrent:
            # Recorded before anything else may raise: postrun gives it back.
            setattr(request, _LEASED, leases.hold(runtime.gate, concurrent, holder))
        setattr(request, leases.ADMITTED, leases.Admitted(runtime.gate, limits, estimated or set()))
    if getattr(task, "acks_late", False):
        if not _move_pointer(task, runtime, state, "ran:"):
            logger.warning("throttle: task %s[%s] dropped: a stale copy (a node died while "
                           "re-scheduling it; its newer copy goes on)", task.name, request.id)
            raise Ignore()
        setattr(request, _STARTED, (runtime, state))  # for _run_ended
    metrics.admitted([lim.name for lim in limits])
    if state.slot is not None or state.since is not None:
        # The task starts now: its booked slot is spent.  Celery's retry() and
        # any re-publish copy request.headers, and a copy still carrying the
        # claim could be honoured a second time within the grace.
        spent = {**WaitState(deferrals=state.deferrals).to_header(), "started_slot": state.slot}
        request.headers = {**(request.headers or {}), HEADER: spent}


def _run_ended(sender: Any = None, task: Any = None, **_: Any) -> None:
    """acks_late: this copy's run ended and its outcome is stored; no copy may run it again.

    A ``task_postrun`` receiver: Celery sends it after the result is stored
    and callbacks are sent, so a node dying before then leaves "ran:", and
    the redelivered message runs again (acks_late's at-least-once) instead
    of being dropped with no result.
    """
    request = getattr(task, "request", None)
    started = getattr(request, _STARTED, None)
    if isinstance(started, tuple):
        setattr(request, _STARTED, None)
        runtime, state = started
        _move_pointer(task, runtime, state, "done:")


signals.task_postrun.connect(_run_ended, weak=False)


def _prepare_metrics(**_: Any) -> None:
    metrics.prepare()  # in the worker, before the pool forks: never on a task's path


signals.worker_init.connect(_prepare_metrics, weak=False)


def _release_leases_of(task: Task[Any, Any]) -> None:
    """Give back the concurrency leases the current run of ``task`` holds, once."""
    held = getattr(task.request, _LEASED, None)
    if held is not None:
        setattr(task.request, _LEASED, None)
        leases.release(held)


def _release_leases(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_postrun``: the run ended in any state (success, failure, retry, ignore)."""
    if task is not None and getattr(task, "request", None) is not None:
        _release_leases_of(task)


signals.task_postrun.connect(_release_leases, weak=False)


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
    started = getattr(request, _STARTED, None)
    state = started[1] if isinstance(started, tuple) else WaitState.from_request(request)
    setattr(request, _STARTED, None)  # this copy's run did not complete
    names = ", ".join(sorted({lim.name for lim in limits}))
    try:
        seconds = max(seconds, runtime.gate.pause(limits, seconds))
    except redis.RedisError as exc:
        metrics.store_error([lim.name for lim in limits])
        logger.warning("throttle: could not pause %s (%s: %s); task %s[%s] waits %.3fs anyway",
                       names, type(exc).__name__, exc, task.name, request.id, seconds)
    # Only now: a slot freed before the pause was written could let another
    # call through to the provider that just refused.
    _release_leases_of(task)
    new = WaitState(deferrals=state.deferrals + 1, since=state.since, copy=_new_copy(),
                    prev=state.copy_id, spacing=_spacing(limits))
    if not _park(task, runtime, new, delay_us=math.ceil(max(seconds, 0.0) * 1e6)):
        _republish(task, new, min(max(seconds, 0.001), runtime.config.max_countdown))
    if getattr(task, "acks_late", False):
        _move_pointer(task, runtime, state, new.copy)
    metrics.deferred(limits[0].name if limits else "(provider)", seconds)
    logger.info("throttle: task %s[%s] refused by the provider: %s paused %.3fs on every "
                "worker; re-scheduled (deferral %d)", task.name, request.id, names, seconds,
                new.deferrals)
    raise Ignore()


def _wait_for_slot(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit],
                   max_wait: float | None, state: WaitState, holder: str,
                   released: bool = False) -> bool:
    """Return True when the gate admitted the task, False when the store-down policy did."""
    request = task.request
    config = runtime.config
    # Book no slot the task could not use: past its expiry or its max_wait.
    horizon = config.horizon
    to_expiry = _seconds_to_expiry(request)
    if to_expiry is not None:
        horizon = min(horizon, max(0.0, to_expiry))
    if max_wait is not None:
        horizon = min(horizon, max_wait)
    claim = state.claim_under(limits)
    # A short wait is slept, then the booked slot claimed: the claim is what
    # charges the limits the slot is not booked in.  Bounded: if the slot is
    # lost again and again, the task waits outside the worker instead.
    grace = _grace(runtime, limits, claim.booked if claim is not None else 0)
    # A copy released from the waiting room arrives up to the release lead
    # early: it sleeps that, whatever throttle_max_sleep says (parking it
    # again for less would loop).
    max_sleep = max(config.max_sleep, config.release_lead + 0.1) if released \
        else config.max_sleep
    for attempt in range(_MAX_SLEEPS):
        try:
            decision = runtime.gate.acquire_many(
                limits, reserve=horizon, claim=claim, grace=grace, holder=holder)
        except redis.RedisError as exc:
            metrics.store_error([lim.name for lim in limits])
            _store_failed(task, runtime, state, exc)
            return False
        if decision.allowed:
            return True
        if claim is not None and claim.booked and not decision.early:
            # Arrived after its slot's grace, or a limit it was not booked in
            # is busy: the slot is lost (a little throughput) rather than used
            # late (that could burst).
            logger.info("throttle: task %s[%s] lost its slot (%.3fs ago); asking again",
                        task.name, request.id, (decision.now - claim.slot) / 1e6)
        waited = (decision.now - state.since) / 1e6 if state.since else 0.0
        if to_expiry is not None and decision.retry_after > to_expiry:
            _expire(task, decision)
        if max_wait is not None and waited + decision.retry_after > max_wait:
            raise ThrottleTimeout.exceeded(task.name, _limit_name(decision),
                                           waited + decision.retry_after, max_wait)
        if (decision.reservation is None or decision.retry_after > max_sleep
                or attempt == _MAX_SLEEPS - 1):
            break
        # Our slot is booked: a short wait is cheaper slept than re-published.
        time.sleep(decision.retry_after)
        if claim is None or decision.slot != claim.slot:
            # A new slot: its grace follows the limits it is booked in.  (An
            # "early" answer for the same slot keeps the grace it was given.)
            grace = _grace(runtime, limits, decision.reservation.booked)
        claim = decision.reservation
    if decision.slot is not None:
        countdown = decision.retry_after
    else:
        # Nothing booked (the wait is beyond the horizon): come back when a
        # slot is within reach.
        countdown = max(decision.retry_after - horizon, config.max_sleep, 0.001)
    booking = decision.reservation
    new = WaitState(slot=booking.slot if booking else None,
                    booked=booking.booked if booking else 0,
                    epoch=booking.epoch if booking else 0, deferrals=state.deferrals + 1,
                    since=state.since or decision.now, copy=_new_copy(), prev=state.copy_id,
                    spacing=_spacing(limits))
    name = _limit_name(decision)
    note = _wait_note(task, name, decision, new)
    # Released a lead before the slot, on the server clock the slot is on.
    release_at = decision.now + math.ceil(countdown * 1e6) - math.ceil(config.release_lead * 1e6)
    parked = _park(task, runtime, new, at_us=max(release_at, 1), note=note)
    if not parked:
        _republish(task, new, min(countdown, config.max_countdown))
    if getattr(task, "acks_late", False):
        _move_pointer(task, runtime, state, new.copy)
    metrics.deferred(name, decision.retry_after)
    if not parked:
        _note_wait(task, runtime, note, decision.retry_after)
    logger.info("throttle: task %s[%s] waits %.3fs for limit %r (deferral %d%s)",
                task.name, request.id, decision.retry_after, name, new.deferrals,
                ", parked" if parked else "")
    raise Ignore()


def _wait_key(runtime: Runtime, task_id: str) -> str:
    return task_key(runtime.config.prefix, "wait", task_id)


# A wait note is kept this long after the start it announces.
_NOTE_AFTER_MS = 60_000


def _wait_note(task: Task[Any, Any], limit: str, decision: Decision, state: WaitState) -> str:
    """Why and until when the task waits, for ``celery throttle why`` (JSON)."""
    due = decision.now + int(decision.retry_after * 1e6)
    return json.dumps({"task": task.name, "limit": limit, "due": due,
                       "booked": bool(state.booked), "deferrals": state.deferrals,
                       "since": state.since})


def _note_wait(task: Task[Any, Any], runtime: Runtime, note: str, wait: float) -> None:
    """Record ``note`` (best effort): one SET per re-publish, expiring a minute after the start.

    (A parked task's note is written by the script that parks it.)
    """
    ttl_ms = int(wait * 1000) + _NOTE_AFTER_MS
    # Best effort: the deferral itself is what matters; the note is for operators.
    with contextlib.suppress(redis.RedisError):
        runtime.gate.client.set(_wait_key(runtime, str(task.request.id)), note, px=ttl_ms)


def _park(task: Task[Any, Any], runtime: Runtime, state: WaitState, *, at_us: int = 0,
          delay_us: int = 0, note: str = "") -> bool:
    """Park the task in the waiting room until ``at_us`` (server clock) or ``delay_us`` from now.

    False when it cannot be parked (the waiting room is off, the app was
    never installed so no worker releases it, or the store failed): the
    caller re-publishes it with a countdown instead, never losing it.
    """
    if not runtime.config.waiting_room or not getattr(task.app, INSTALLED, False):
        return False
    request = task.request
    entry = f"{key_digest(str(request.id))}:{state.copy}"
    headers = {**(request.headers or {}), HEADER: replace(state, entry=entry).to_header()}
    envelope = capture(task.signature_from_request(request, headers=headers))
    try:
        runtime.room.park(entry, envelope.dumps(), str(request.id), at_us=at_us,
                          delay_us=delay_us, note=note, note_ttl_ms=_NOTE_AFTER_MS)
    except redis.RedisError as exc:
        metrics.store_error(["(waiting room)"])
        _log_outage(exc, "re-published with a countdown instead of parked")
        return False
    return True


def _first_arrival(task: Task[Any, Any], runtime: Runtime, state: WaitState) -> bool:
    """A copy released from the waiting room: is it the first of its entry to arrive?

    With the store down this is the store-down policy's call (``defer``
    re-publishes the copy, still naming its entry, so exactly one copy of
    the entry goes on once the store is back).
    """
    acks_late = getattr(task, "acks_late", False)
    # acks_late: the broker may redeliver this copy after a crash mid-run,
    # as late as its visibility timeout; the marker must outlive that.
    ttl_ms = int(runtime.config.visibility_timeout * 1000) + 60_000 if acks_late else 0
    try:
        return runtime.room.arrive(state.entry, state.token, state.room, marker_ttl_ms=ttl_ms)
    except redis.RedisError as exc:
        metrics.store_error(["(waiting room)"])
        _store_failed(task, runtime, state, exc)
        return True  # policy "allow"


def read_wait(runtime: Runtime, task_id: str) -> dict[str, Any] | None:
    """What the last deferral of ``task_id`` recorded, with times relative to now (or None)."""
    pipe = runtime.gate.client.pipeline(transaction=False)
    pipe.get(_wait_key(runtime, task_id))
    pipe.time()
    raw, (sec, usec) = pipe.execute()
    if raw is None:
        return None
    note = json.loads(raw)
    now = int(sec) * 1_000_000 + int(usec)
    note["due_in_s"] = round((note["due"] - now) / 1e6, 3)
    note["waiting_s"] = round((now - (note["since"] or now)) / 1e6, 3)
    return dict(note)


def _move_pointer(task: Task[Any, Any], runtime: Runtime, state: WaitState, then: str) -> bool:
    """acks_late: may this copy go on?  If so, point the task at ``then``.

    ``then`` is a successor's copy id, or "ran:"/"done:" (this copy's id is
    appended).  One script call per start, end and re-publish of an
    acks_late task.  The pointer outlives the time a stranded copy can take
    to come back: the broker's visibility timeout plus the longest booked
    wait.  With the store down the answer is yes: a copy re-published
    meanwhile names this one as its predecessor, so the pointer still lets
    exactly one through.
    """
    mine = state.copy_id
    then_value = then + mine if then.endswith(":") else then
    request = task.request
    key = f"{{{runtime.config.prefix}}}:copy:{key_digest(str(request.id))}:{request.retries}"
    ttl_ms = int((runtime.config.visibility_timeout + runtime.config.horizon) * 1000) + 60_000
    client = runtime.gate.client
    script = client.register_script(_COPIES)  # no I/O: EVALSHA, reloaded on NOSCRIPT
    try:
        moved = script(keys=[key], args=[mine, state.prev, then_value, ttl_ms])
    except redis.RedisError as exc:
        if then == "ran:":
            _store_failed(task, runtime, state, exc)
        return True
    return bool(moved)


def _new_copy() -> str:
    return secrets.token_hex(8)


def _limit_name(decision: Decision) -> str:
    return decision.limit.name if decision.limit is not None else "(booked slot)"


def _republish(task: Task[Any, Any], state: WaitState, countdown: float) -> None:
    request = task.request
    headers = {**(request.headers or {}), HEADER: state.to_header()}
    # signature_from_request keeps id, args, queue/routing, priority, links,
    # chain, expires, time limits and `retries` (so max_retries is untouched).
    task.signature_from_request(request, countdown=countdown, headers=headers).apply_async()


def _expire(task: Task[Any, Any], decision: Decision) -> None:
    request = task.request
    logger.info("throttle: task %s[%s] expires before its slot (%.3fs away); not run",
                task.name, request.id, decision.retry_after)
    task.backend.mark_as_revoked(str(request.id), "expired", request=request)
    raise Ignore()


def _store_failed(task: Task[Any, Any], runtime: Runtime, state: WaitState,
                  exc: redis.RedisError) -> None:
    policy = runtime.config.on_error
    _log_outage(exc, f"policy {policy!r}")
    if policy == "allow":
        return
    if policy == "fail":
        raise ThrottleStoreError(f"throttle store unavailable for task {task.name!r}: "
                                 f"{type(exc).__name__}") from exc
    # "defer": never run unthrottled, never lost; back off 1, 2, 4 ... 30 s
    # with jitter so that a fleet of waiting tasks does not return in step.
    backoff = min(30.0, 2.0 ** min(state.deferrals, 5)) * random.uniform(0.5, 1.0)
    new = replace(state, deferrals=state.deferrals + 1, copy=_new_copy(), prev=state.copy_id)
    # The copy pointer is not moved (the store is down): the new copy names
    # this one as its predecessor, which the pointer accepts.
    _republish(task, new, backoff)
    logger.info("throttle: task %s[%s] re-scheduled in %.1fs: store unavailable (deferral %d)",
                task.name, task.request.id, backoff, new.deferrals)
    raise Ignore()


def _log_outage(exc: redis.RedisError, what: str) -> None:
    """Report the store being down once per ``_OUTAGE_LOG_EVERY`` per process, not per task."""
    global _last_outage_log
    now = time.monotonic()
    if now - _last_outage_log >= _OUTAGE_LOG_EVERY:
        _last_outage_log = now
        # The exception's text names host and port, never the password.
        logger.warning("throttle: store unavailable (%s: %s); %s", type(exc).__name__, exc,
                       what)
