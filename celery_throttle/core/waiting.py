"""Waiting for a slot outside Celery: one plan, driven by a sync and an async driver.

``Gate.acquire`` answers "now or not"; code outside a worker (a web handler,
a script, a notebook) then needs to wait, and a sleep-and-retry loop is the
thundering herd.  :func:`plan` is that loop done once: it books the
earliest slot (so N waiters get N distinct, evenly spaced slots), sleeps
until it, claims it (a slot within :data:`NEAR` is admitted as it is
booked: one script call per start), and gives up with :class:`~celery_throttle.ThrottleTimeout`
when the wait would pass the timeout, before booking anything.  A waiter
admitted for its slot just ahead sleeps until it and then checks it woke in
time (:func:`late_by`): later than the grace, it claims the slot again rather
than start late (the gate finds the slot lost and decides afresh).  The drivers
(:func:`wait`, :func:`await_slot`) only do its I/O, so both behave alike; a
waiter interrupted while it holds a booking (KeyboardInterrupt, asyncio
cancellation) gives the booking back, and one interrupted after its
admission gives back its leases too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import ThrottleTimeout
from ..values import LONGEST_WAIT, renew_every
from .limits import AnyLimit, Concurrency, Decision, Reservation

__all__ = ["NEAR", "Ask", "Sleep", "ahold", "await_slot", "hold", "late_by", "limited", "plan",
           "wait"]


class Gate(Protocol):
    """What waiting needs of a :class:`~celery_throttle.Gate` (which imports this module)."""

    def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = ...,
                     claim: Reservation | None = ..., grace: float = ...,
                     holder: str = ..., near: float = ...) -> Decision: ...
    def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int: ...
    def extend(self, limits: Sequence[AnyLimit], holder: str) -> int: ...
    def release(self, limits: Sequence[AnyLimit], holder: str, ran_for: float = ...) -> int: ...


class AsyncGate(Protocol):
    """What waiting needs of an :class:`~celery_throttle.AsyncGate`."""

    async def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = ...,
                           claim: Reservation | None = ..., grace: float = ...,
                           holder: str = ..., near: float = ...) -> Decision: ...
    async def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int: ...
    async def extend(self, limits: Sequence[AnyLimit], holder: str) -> int: ...
    async def release(self, limits: Sequence[AnyLimit], holder: str,
                      ran_for: float = ...) -> int: ...

F = TypeVar("F", bound=Callable[..., Any])
#: How late a waiter may claim its slot (it sleeps to the slot, so it is late
#: only by its own scheduling): as the workers' floor.
DEFAULT_GRACE = 0.05
_MAX_STEPS = 10_000  # a bound on any plan's rounds (each sleeps, so it is never reached)
#: Late wake-ups from a sleep to an admitted start that claim the slot again;
#: after that many in a row the caller's machine cannot do better: it starts.
MAX_LATE_WAKES = 3
#: A slot at most this far ahead is admitted in the call that books it (one
#: script call per start; further ones are booked, then claimed).  A pause (a
#: provider's 429) or a settlement written before the slot does not reach
#: such a start, as it does not reach a request already sent: a provider's
#: calls stay in flight for a second or more, so a quarter second adds few.
NEAR = 0.25


def late_by(asked: float, ahead: float, clock: Callable[[], float] = time.monotonic) -> float:
    """How late a caller that asked at ``asked`` (``clock``'s time) for a start ``ahead``
    seconds after its answer woke from its sleep (seconds; negative: in time).

    A loaded machine (or a container out of its CPU quota, or a busy event
    loop) can run a sleeper 100 ms after its timer; starting that late would
    come closer than an interval to the next start, which keeps its own
    moment.  Past the claim grace, a caller claims its slot again instead.
    """
    return clock() - asked - ahead


@dataclass(frozen=True, slots=True)
class Ask:
    """Call ``acquire_many`` with these and send the decision back."""

    reserve: float
    claim: Reservation | None
    near: float


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep ``seconds``; ``booking`` is what to give back if the sleep is interrupted."""

    seconds: float
    booking: Reservation | None


def plan(limits: Sequence[AnyLimit], timeout: float | None,
         clock: Callable[[], float] = time.monotonic, grace: float = DEFAULT_GRACE,
         near: float = NEAR) -> Generator[Ask | Sleep, Any, Decision]:
    """The waiting loop as steps: yields :class:`Ask` and :class:`Sleep`, returns the admission.

    Raises ThrottleTimeout, naming the limit and the wait, as soon as the next
    start is further away than the time left (nothing is booked then).
    ``grace``: as late as a start may come after its slot (the claims' grace);
    ``near``: a slot this close is admitted as it is booked (:data:`NEAR`).
    """
    deadline = None if timeout is None else clock() + timeout
    claim: Reservation | None = None
    late_wakes = 0
    for _ in range(_MAX_STEPS):
        left = LONGEST_WAIT if deadline is None else max(0.0, deadline - clock())
        asked = clock()
        decision: Decision = yield Ask(reserve=left, claim=claim, near=near)
        if decision.allowed:
            if decision.retry_after > 0:  # admitted for its slot just ahead
                yield Sleep(decision.retry_after, decision.reservation)
                if (decision.reservation is not None and late_wakes < MAX_LATE_WAKES
                        and late_by(asked, decision.retry_after, clock) > grace):
                    late_wakes += 1
                    claim = decision.reservation
                    continue  # its claim again: lost, the gate decides afresh
            return decision
        booking = decision.reservation
        if booking is None or decision.retry_after > left:
            name = decision.limit.name if decision.limit is not None else "?"
            raise ThrottleTimeout(
                f"waiting for limit {name!r} would take {decision.retry_after:.3f}s, past the "
                f"timeout of {timeout:.3f}s" if timeout is not None else
                f"limit {name!r} has no slot within the horizon", limit_name=name,
                waited=decision.retry_after, max_wait=timeout or 0.0)
        # A full concurrency limit books nothing (booked == 0): come back then and ask.
        claim = booking if booking.booked else None
        yield Sleep(decision.retry_after, claim)
    raise RuntimeError("unreachable: every round of the plan sleeps")


def wait(gate: Gate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
         holder: str = "", grace: float = DEFAULT_GRACE) -> Decision:
    """Block until ``limits`` admit one start (booked, so waiters never herd); return it."""
    steps = plan(limits, timeout, grace=grace)
    reply: Any = None
    booking: Reservation | None = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Ask):
                reply = gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                          grace=grace, holder=holder, near=step.near)
            else:
                booking = step.booking
                time.sleep(step.seconds)
                booking, reply = None, None
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        _give_back(gate.cancel, gate.release, limits, booking, holder)
        raise


async def await_slot(gate: AsyncGate, limits: Sequence[AnyLimit], *,
                     timeout: float | None = None, holder: str = "",
                     grace: float = DEFAULT_GRACE) -> Decision:
    """:func:`wait` for asyncio: the same plan, awaiting the gate and ``asyncio.sleep``."""
    steps = plan(limits, timeout, grace=grace)
    reply: Any = None
    booking: Reservation | None = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Ask):
                reply = await gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                                grace=grace, holder=holder, near=step.near)
            else:
                booking = step.booking
                await asyncio.sleep(step.seconds)
                booking, reply = None, None
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        # Cancelled: give back on a task of its own, which the cancellation cannot reach.
        await asyncio.shield(_agive_back(gate, limits, booking, holder))
        raise


def _give_back(cancel: Callable[..., Any], release: Callable[..., Any],
               limits: Sequence[AnyLimit], booking: Reservation | None, holder: str) -> None:
    with contextlib.suppress(Exception):  # the interruption is what the caller sees
        if booking is not None:
            cancel(limits, booking)
        if holder and any(lim.leased for lim in limits):
            release(limits, holder)


async def _agive_back(gate: AsyncGate, limits: Sequence[AnyLimit],
                      booking: Reservation | None, holder: str) -> None:
    with contextlib.suppress(Exception):
        if booking is not None:
            await gate.cancel(limits, booking)
        if holder and any(lim.leased for lim in limits):
            await gate.release(limits, holder)


def _leases(limits: Sequence[AnyLimit]) -> list[Concurrency]:
    return [lim for lim in limits if isinstance(lim, Concurrency)]


@contextlib.contextmanager
def hold(gate: Gate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
         holder: str | None = None, grace: float = DEFAULT_GRACE) -> Iterator[Decision]:
    """Wait for a start, then run the block holding its concurrency seats.

    The leases are renewed every third of the shortest lease by a thread
    while the block runs (so it may outlast the lease) and given back when
    it exits, however it exits.
    """
    holder = holder or uuid.uuid4().hex
    decision = wait(gate, limits, timeout=timeout, holder=holder, grace=grace)
    leases = _leases(limits)
    if not leases:
        yield decision
        return
    stop = threading.Event()

    def renew() -> None:
        every = renew_every([lim.lease for lim in leases])
        while not stop.wait(every):
            with contextlib.suppress(Exception):  # a missed beat is retried at the next
                gate.extend(leases, holder)

    beat = threading.Thread(target=renew, name="celery_throttle-lease", daemon=True)
    beat.start()
    started = time.monotonic()
    try:
        yield decision
    finally:
        stop.set()
        beat.join()
        gate.release(leases, holder, ran_for=time.monotonic() - started)


@contextlib.asynccontextmanager
async def ahold(gate: AsyncGate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
                holder: str | None = None,
                grace: float = DEFAULT_GRACE) -> AsyncIterator[Decision]:
    """:func:`hold` for asyncio: the leases are renewed by a task while the block runs."""
    holder = holder or uuid.uuid4().hex
    decision = await await_slot(gate, limits, timeout=timeout, holder=holder, grace=grace)
    leases = _leases(limits)
    if not leases:
        yield decision
        return

    async def renew() -> None:
        every = renew_every([lim.lease for lim in leases])
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(Exception):
                await gate.extend(leases, holder)

    beat = asyncio.ensure_future(renew())
    started = time.monotonic()
    try:
        yield decision
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await asyncio.shield(gate.release(leases, holder, ran_for=time.monotonic() - started))


def limited(gate: Gate | AsyncGate, limits: Sequence[AnyLimit], timeout: float | None,
            grace: float = DEFAULT_GRACE) -> Callable[[F], F]:
    """The decorator of :meth:`Gate.limit` / :meth:`AsyncGate.limit`."""
    gate_is_async = inspect.iscoroutinefunction(gate.acquire_many)

    def decorate(fn: F) -> F:
        is_async = inspect.iscoroutinefunction(fn)
        if is_async != gate_is_async:
            kind = "a coroutine function" if is_async else "a plain function"
            raise TypeError(f"{fn.__qualname__} is {kind}: decorate plain functions with "
                            "Gate.limit and coroutine functions with AsyncGate.limit")
        if gate_is_async:
            agate: AsyncGate = gate  # type: ignore[assignment]

            @functools.wraps(fn)
            async def arun(*args: Any, **kwargs: Any) -> Any:
                async with ahold(agate, limits, timeout=timeout, grace=grace):
                    return await fn(*args, **kwargs)

            return arun  # type: ignore[return-value]
        sgate: Gate = gate  # type: ignore[assignment]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with hold(sgate, limits, timeout=timeout, grace=grace):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate
