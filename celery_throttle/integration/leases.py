"""What a running task holds: concurrency leases (renewed by a heartbeat) and settle().

A task admitted under a concurrency limit holds a lease in Redis under its
task id (``decide.lua`` takes it atomically with the task's other limits).
While the run lasts, one daemon thread per worker process renews every lease
the process holds, every third of the shortest lease; when the run ends in
any state, ``task_postrun`` gives the lease back.  A process that dies
(SIGKILL, OOM, a hard time limit) renews nothing, and its leases expire one
lease time later, reclaimed by the next decision on that limit.

:func:`settle` corrects an estimated cost once the task knows the true one
(the provider's ``usage``).
"""

from __future__ import annotations

import os
import threading
import time

import redis
from celery import current_task

from ..core.gate import Gate
from ..core.limits import Concurrency, rates_of
from ..core.logs import logger
from ..values import renew_every, units
from .run import Admitted, Held, run_of

__all__ = ["Admitted", "Held", "hold", "release", "settle"]


# The heartbeat's longest sleep, so a new, shorter lease is renewed in time.
_MAX_BEAT = 5.0


class _Heartbeat:
    """One daemon thread per process renewing the leases its runs hold."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[int, Held] = {}
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.pid = 0

    def add(self, held: Held) -> None:
        with self.lock:
            self.held[id(held)] = held
            # A prefork child inherits the parent's object but not its thread.
            if self.thread is None or self.pid != os.getpid() or not self.thread.is_alive():
                self.pid = os.getpid()
                self.wake = threading.Event()
                self.thread = threading.Thread(target=self._run, name="celery-throttle-leases",
                                               daemon=True)
                self.thread.start()
        self.wake.set()  # a shorter lease may need an earlier beat

    def remove(self, held: Held) -> None:
        with self.lock:
            self.held.pop(id(held), None)

    def _period(self) -> float:
        with self.lock:
            leases = [lim.lease for h in self.held.values() for lim in h.limits]
        return min(_MAX_BEAT, renew_every(leases)) if leases else _MAX_BEAT

    def _run(self) -> None:
        wake = self.wake
        due = time.monotonic() + self._period()
        while True:
            wake.wait(max(0.0, due - time.monotonic()))
            wake.clear()
            if time.monotonic() < due:
                # Woken by a new lease: only its beat may come sooner.  (Renewing
                # now would extend a lease granted a moment ago: a store call per
                # admission for nothing.)
                due = min(due, time.monotonic() + self._period())
                continue
            with self.lock:
                current = list(self.held.values())
            for held in current:
                self._renew(held)
            due = time.monotonic() + self._period()

    def _renew(self, held: Held) -> None:
        try:
            with held.lock:
                if held.released:
                    return
                lost = held.gate.extend(held.limits, held.holder)
        except redis.RedisError as exc:
            # Renewal is retried at the next beat; a lease outlives a few misses.
            logger.warning("throttle: could not renew the leases of task %s (%s: %s)",
                           held.holder, type(exc).__name__, exc)
            return
        if lost and not held.lost:
            held.lost = True
            logger.warning("throttle: task %s lost %d concurrency lease(s) (not renewed for a "
                           "whole lease and the slots were taken); it runs on without them",
                           held.holder, lost)


_heartbeat = _Heartbeat()


def hold(gate: Gate, limits: list[Concurrency], holder: str) -> Held:
    """Start renewing the leases ``holder`` was just given."""
    held = Held(gate, limits, holder)
    _heartbeat.add(held)
    return held


def release(held: Held) -> None:
    """Give the leases back (best effort: if the store is down they expire on their own)."""
    _heartbeat.remove(held)
    try:
        with held.lock:
            held.released = True
            held.gate.release(held.limits, held.holder, time.monotonic() - held.since)
    except redis.RedisError as exc:
        logger.warning("throttle: could not release the leases of task %s (%s: %s); they "
                       "expire within %.0fs", held.holder, type(exc).__name__, exc,
                       max(lim.lease for lim in held.limits))


def settle(actual: int, limit: str | None = None) -> bool:
    """Correct the current task's estimated cost to ``actual`` units (e.g. tokens used).

    Call it from a throttled task once the true cost is known.  ``limit``
    names the limit; it may be left out when exactly one of the task's
    limits has a computed (estimated) cost.  The bucket is charged or
    refunded the difference; a second call corrects the first.  Returns
    False without effect outside a worker run admitted by the gate (direct
    calls, eager mode), or if the store cannot be reached (logged).
    """
    units("actual cost", actual)
    task = current_task
    run = run_of(getattr(task, "request", None))
    admitted = run.admitted if run is not None else None
    if admitted is None:
        return False
    rates = rates_of(admitted.limits)
    if limit is None:
        chosen = [lim for lim in rates if lim.name in admitted.estimated]
        if len(chosen) != 1:
            raise ValueError("settle() needs limit=...: the task's limits with an estimated "
                             f"cost are {sorted(lim.name for lim in chosen)!r}")
    else:
        chosen = [lim for lim in rates if lim.name == limit]
        if not chosen:
            raise ValueError(f"settle(): the task has no rate limit {limit!r} (its limits: "
                             f"{sorted({lim.name for lim in admitted.limits})!r})")
    try:
        for lim in chosen:
            admitted.gate.settle(lim, actual, charged=admitted.charged.get(lim.name))
            admitted.charged[lim.name] = actual
    except redis.RedisError as exc:
        logger.warning("throttle: could not settle limit %r (%s: %s)", chosen[0].name,
                       type(exc).__name__, exc)
        return False
    return True
