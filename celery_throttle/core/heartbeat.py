"""One heartbeat per process renews the concurrency leases its holders hold.

A holder admitted under a concurrency limit holds a lease in Redis under its
id; it must renew it while it runs, or the seat goes to the next after one
lease time.  One daemon thread per process renews every lease held there,
every third of the shortest lease (at most every 5 s, so a new and shorter
lease is renewed in time): a worker's runs (``integration/leases.py``) and a
caller waiting in place (``Gate.admitted``, ``waiting.hold``) alike.  The asyncio
gate's holders renew from a task on their own event loop instead
(``waiting.ahold``): a thread would need a loop of its own for their client.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis

from ..values import renew_every
from .limits import AnyLimit, Concurrency
from .logs import logger

__all__ = ["Held", "hold", "release", "stop"]


class Renews(Protocol):
    """What the heartbeat needs of a gate."""

    def extend(self, limits: Sequence[AnyLimit], holder: str) -> int: ...
    def release(self, limits: Sequence[AnyLimit], holder: str, ran_for: float = ...) -> int: ...


@dataclass(eq=False)
class Held:
    """The leases one holder holds."""

    gate: Renews
    limits: list[Concurrency]
    holder: str
    since: float = field(default_factory=time.monotonic)
    lost: bool = False
    released: bool = False
    # Taken by a renewal and by the release: a renewal that overtook the release would
    # take the freed seat again, held by nobody for a lease.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


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
                           "whole lease and the seats were taken); it runs on without them",
                           held.holder, lost)


_heartbeat = _Heartbeat()


def hold(gate: Renews, limits: list[Concurrency], holder: str) -> Held:
    """Start renewing the leases ``holder`` was just given."""
    held = Held(gate, limits, holder)
    _heartbeat.add(held)
    return held


def stop(held: Held) -> None:
    """Stop renewing ``held`` without giving it back (its holder gives it back itself): a
    renewal under way ends first, and none begins after."""
    _heartbeat.remove(held)
    with held.lock:
        held.released = True


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
