"""After a gated task started: its run's end, and the provider's refusal that sends it back.

:func:`release_leases_of` gives back the seats a run holds as it ends in any
state; :func:`run_ended` tells the copy pointer its run has ended (no copy
may run it again); :func:`defer_after_start` sends a running task back
after the provider refused the call (a 429's pause, a spent account's stop,
an overload): the limits wait everywhere, the task comes back uncharged,
its retries not spent.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import redis
from celery import Task

from .. import metrics
from ..core.limits import AnyLimit, pauses_for_refusal
from ..core.logs import logger
from ..room.header import WaitState
from . import leases
from .admission import Away, Drop
from .copies import new_copy
from .exits import move_pointer, pointed_copy, send_back
from .run import run_of
from .runtime import Runtime
from .visible import announce
from .waiter import Waiter

__all__ = ["defer_after_start", "release_leases_of", "run_ended"]


def run_ended(task: Task[Any, Any]) -> None:
    """A pointed copy's run ended (its outcome is stored): no copy may run it again.

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
        move_pointer(Waiter.of_run(task), run.runtime, state, "done:")


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
                      seconds: float, stop: str | None = None,
                      overloaded: bool = False, named: bool = True,
                      refused_after: float | None = None) -> Away | Drop:
    """The provider refused the call (429): pause ``limits`` everywhere, re-schedule the task;
    the copy's way out (``act.carry_out``): :class:`Away`, or a :class:`Drop` where the
    waiting room has this copy already.

    The pause is written to the gate, so every worker's next decision for
    these limits waits it out, and starts booked before it ends are void.
    The task comes back after ``seconds`` (in hops of at most
    ``throttle_max_countdown``) and asks the gate again; its retries are
    not spent.  With the store down the task is still re-scheduled.
    ``stop``: the provider said the money is spent (its words): the limits
    stop until resumed (``Gate.stop``, said once as an ERROR), and the task,
    back after ``seconds``, waits in line for that.  ``overloaded``: the
    provider is busy for everyone: the limits are held off for ``seconds``
    (``Gate.follow`` with nothing left until then), not paused.  A quota
    refusal of a request sent ``refused_after`` seconds ago cuts the limits
    that learn their rate, paused only for a wait the provider ``named``
    (``pauses_for_refusal``); with every limit learning and none named, the
    task comes back at once and waits for its start at the new rate.
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
        if stop is not None:
            # Back after ``seconds`` as for a pause: it then finds the stop and waits in
            # line, where a resume serves it (a timer would hold it the stop's length).
            if runtime.gate.stop(limits, "money", stop):
                logger.error("throttle: %s stopped on every worker until resumed: the provider "
                             "says the account's money is spent (%r); `celery throttle "
                             "resume NAME` once it is not", names, stop)
        elif overloaded:
            runtime.gate.follow(limits, 0, seconds)
        else:
            groups = pauses_for_refusal(limits, seconds, named)
            seconds = max(runtime.gate.pause(group, wait, refused_after=refused_after)
                          for group, wait in groups)
    except redis.RedisError as exc:
        store_up = False
        metrics.store_error([lim.name for lim in limits])
        logger.warning("throttle: could not pause %s (%s: %s); task %s[%s] waits %.3fs anyway",
                       names, type(exc).__name__, exc, task.name, request.id, seconds)
    # Only now: a seat freed before the pause was written could let another
    # call through to the provider that just refused.
    release_leases_of(task)
    # (It waits for the provider now, whatever brought it here.)
    new = replace(state.successor(new_copy(), limits, state.since), rerun=False)
    sent = send_back(task, runtime, new, seconds)
    if isinstance(sent, Drop):
        return sent
    new = sent
    waiter = Waiter.of_run(task)
    if pointed_copy(task, state):
        move_pointer(waiter, runtime, state, new.copy)
    metrics.deferred(limits[0].name if limits else "(provider)", seconds)
    if store_up:  # (as in the store-down path, a backend beside it may be down too)
        announce(waiter, limit=names or "(provider)", wait=seconds,
                 deferrals=new.deferrals, reason="provider")
    logger.info("throttle: task %s[%s] refused by the provider: %s paused %.3fs on every "
                "worker; re-scheduled (deferral %d)", task.name, request.id, names, seconds,
                new.deferrals)
    return Away()
