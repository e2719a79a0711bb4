"""The one waiting loop: for ``Gate.wait`` and its helpers, and for a task in a worker.

``Gate.acquire`` answers "now or not"; a caller that must wait then needs a
loop, and a sleep-and-retry loop is the thundering herd.  :func:`plan` is
that loop, written once as steps (:class:`Ask` the gate, :class:`Sleep`):
it books the earliest start (so N waiters get N distinct, evenly spaced
booked starts), sleeps until it, claims it (a booked start within ``near`` is admitted as it
is booked: one script call per start), and checks that it woke in time
(:func:`late_by`): later than the grace, it claims the booked start again rather
than start late (the gate finds the booked start lost and decides afresh).  A
waiter with a deadline gives up with :class:`~celery_throttle.ThrottleTimeout`
when the wait would pass it, before booking anything.

A caller that can wait somewhere else (a task in a worker: parked in the
waiting room, or re-published) says which waits it does not sleep here
(``elsewhere``, and any wait in line): the plan then ends with that refusal
for the caller to act on.  The drivers (:func:`drive`, :func:`adrive`) only do
the I/O, so ``Gate.wait``, ``AsyncGate.wait`` and a worker's task wait alike;
a waiter interrupted while it holds a booking (KeyboardInterrupt, asyncio
cancellation, a worker's time limit) gives the booking back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import ThrottleTimeout
from ..values import LONGEST_WAIT, from_us, renew_every
from . import heartbeat
from .limits import AnyLimit, Decision, Reservation, seats_of

__all__ = ["NEAR", "Ask", "Outcome", "Sleep", "adrive", "ahold", "await_start", "drive", "hold",
           "late_by", "limited", "plan", "wait"]


class Gate(Protocol):
    """What waiting needs of a :class:`~celery_throttle.Gate` (which imports this module)."""

    def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = ...,
                     claim: Reservation | None = ..., grace: float = ...,
                     holder: str = ..., in_line: bool = ..., near: float = ...) -> Decision: ...
    def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int: ...
    def extend(self, limits: Sequence[AnyLimit], holder: str) -> int: ...
    def release(self, limits: Sequence[AnyLimit], holder: str, ran_for: float = ...) -> int: ...


class AsyncGate(Protocol):
    """What waiting needs of an :class:`~celery_throttle.AsyncGate`."""

    async def acquire_many(self, limits: Sequence[AnyLimit], *, reserve: float | None = ...,
                           claim: Reservation | None = ..., grace: float = ...,
                           holder: str = ..., in_line: bool = ...,
                           near: float = ...) -> Decision: ...
    async def cancel(self, limits: Sequence[AnyLimit], booking: Reservation) -> int: ...
    async def extend(self, limits: Sequence[AnyLimit], holder: str) -> int: ...
    async def release(self, limits: Sequence[AnyLimit], holder: str,
                      ran_for: float = ...) -> int: ...

F = TypeVar("F", bound=Callable[..., Any])
#: How late a waiter may claim its booked start (it sleeps to the booked start, so it is late
#: only by its own scheduling): as the workers' floor.
DEFAULT_GRACE = 0.05
_MAX_STEPS = 10_000  # a bound on any plan's rounds (each sleeps, so it is never reached)
#: Late wake-ups from a sleep to an admitted start that claim the booked start again;
#: after that many in a row the caller's machine cannot do better: it starts.
MAX_LATE_WAKES = 3
#: A booked start at most this far ahead is admitted in the call that books it (one
#: script call per start; further ones are booked, then claimed).  A pause (a
#: provider's 429) or a settlement written before the booked start does not reach
#: such a start, as it does not reach a request already sent: a provider's
#: calls stay in flight for a second or more, so a quarter second adds few.
NEAR = 0.25


def late_by(asked: float, ahead: float, clock: Callable[[], float] = time.monotonic) -> float:
    """How late a caller that asked at ``asked`` (``clock``'s time) for a start ``ahead``
    seconds after its answer woke from its sleep (seconds; negative: in time).

    A loaded machine (or a container out of its CPU quota, or a busy event
    loop) can run a sleeper 100 ms after its timer; starting that late would
    come closer than an interval to the next start, which keeps its own
    moment.  Past the claim grace, a caller claims its booked start again instead.
    """
    return clock() - asked - ahead


@dataclass(frozen=True, slots=True)
class Ask:
    """Call ``acquire_many`` with these and send the decision back.  ``late``: this ask
    claims again a start the caller woke that many seconds too late for (0: it did not)."""

    reserve: float
    claim: Reservation | None
    near: float
    grace: float
    in_line: bool = False
    late: float = 0.0


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep ``seconds``; ``booking`` is what to give back if the sleep is interrupted;
    ``admitted``: the start is admitted for the end of this sleep (not a booked start to
    claim)."""

    seconds: float
    booking: Reservation | None
    admitted: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a plan ended: ``decision`` admitted (start now, ``late`` seconds after the
    start it was admitted for: 0 on time or with no booked start), or the refusal the caller
    waits out elsewhere (``elsewhere``, or a wait in line)."""

    decision: Decision
    late: float = 0.0


def _booked_in_all(limits: Sequence[AnyLimit], booked: int) -> bool:
    """The start is booked in every limit (none is a concurrency limit, which cannot be)."""
    return all(not lim.leased and booked >> i & 1 for i, lim in enumerate(limits))


def plan(limits: Sequence[AnyLimit], timeout: float | None = None,
         clock: Callable[[], float] = time.monotonic,
         grace: float | Callable[[int], float] = DEFAULT_GRACE, near: float = NEAR, *,
         horizon: float = LONGEST_WAIT, claim: Reservation | None = None,
         in_line: bool = False, elsewhere: Callable[[Decision], bool] | None = None,
         check: Callable[[Decision], None] | None = None,
         max_sleeps: int = _MAX_STEPS) -> Generator[Ask | Sleep, Any, Outcome]:
    """The waiting loop as steps: yields :class:`Ask` and :class:`Sleep`, returns the
    :class:`Outcome`.

    ``timeout``: raises ThrottleTimeout, naming the limit and the wait, as soon as
    the next start is further away than the time left (nothing is booked then).
    ``grace``: as late as a start may come after its booked start (the claims' grace), or
    a function of the limits a start is booked in (:attr:`Reservation.booked`).
    ``near``: a booked start this close is admitted as it is booked (:data:`NEAR`).
    ``horizon``: book no booked start further ahead.  ``claim``: a start booked before
    (a task's previous arrival).  ``in_line``: the first ask does not start ahead
    of tasks in line (a ``queued`` refusal ends the plan).  ``elsewhere``: the
    refusals the caller waits out elsewhere; without it, a refusal with no booked start
    booked raises ThrottleTimeout.  ``check``: called with every other refusal
    before it is waited (it may raise: a task's expiry or its ``max_wait``).
    ``max_sleeps``: sleeps for a booked start, at most; the refusal after them is
    the caller's to wait elsewhere.
    """
    grace_of = grace if callable(grace) else (lambda _booked, g=grace: g)
    current = grace_of(claim.booked if claim is not None else 0)
    deadline = None if timeout is None else clock() + timeout
    late_wakes = slept = 0
    late = 0.0
    for _ in range(_MAX_STEPS):
        left = LONGEST_WAIT if deadline is None else max(0.0, deadline - clock())
        asked = clock()
        decision: Decision = yield Ask(reserve=min(horizon, left), claim=claim, near=near,
                                       grace=current, in_line=in_line and claim is None,
                                       late=late)
        late = 0.0
        if decision.allowed:
            if decision.retry_after <= 0:
                # A claim honoured after its booked start starts that late (a plain admission
                # has no booked start).
                after = from_us(decision.now - decision.start) if decision.start and \
                    decision.now else 0.0
                return Outcome(decision, max(0.0, after))
            # Admitted for its booked start just ahead: the start is that moment.  Woken later
            # than the grace, it claims the booked start again (the gate finds it lost and
            # decides afresh) rather than this start crowding the next.
            yield Sleep(decision.retry_after, decision.reservation, admitted=True)
            late = late_by(asked, decision.retry_after, clock)
            if decision.reservation is not None and late_wakes < MAX_LATE_WAKES \
                    and late > current:
                late_wakes += 1
                claim = decision.reservation
                continue
            return Outcome(decision, max(0.0, late))
        if decision.queued:
            return Outcome(decision)  # in line: the line's dispatch decides the rest
        if check is not None:
            check(decision)
        booking = decision.reservation
        if elsewhere is None:
            if booking is None or decision.retry_after > left:
                name = decision.limit.name if decision.limit is not None else "?"
                raise ThrottleTimeout(
                    f"waiting for limit {name!r} would take {decision.retry_after:.3f}s, past "
                    f"the timeout of {timeout:.3f}s" if timeout is not None else
                    f"limit {name!r} has no booked start within the horizon", limit_name=name,
                    waited=decision.retry_after, max_wait=timeout or 0.0)
        elif booking is None or slept >= max_sleeps or elsewhere(decision):
            return Outcome(decision)
        assert booking is not None
        if claim is None or booking.start != claim.start:
            # A new booked start: its grace follows the limits it is booked in.  (An "early"
            # answer for the same booked start keeps the grace it was given.)
            current = grace_of(booking.booked)
        # A full concurrency limit books nothing (booked == 0): come back then and ask.
        claim = booking if booking.booked else None
        # Booked in every limit, wake half a grace early: a claim up to the grace
        # ahead is admitted for the booked start itself, while one that lands after it (a
        # sleep's overshoot, the round trip) would push the later booked starts back.  (With
        # a limit it is not booked in, the gate can only admit it at the booked start: an
        # early claim would be told to wait again.)
        ahead = current / 2 if _booked_in_all(limits, booking.booked) else 0.0
        yield Sleep(max(0.0, decision.retry_after - ahead), claim)
        slept += 1
    raise RuntimeError("unreachable: every round of the plan sleeps")


def drive(steps: Generator[Ask | Sleep, Any, Outcome], ask: Callable[[Ask], Decision],
          sleep: Callable[[Sleep], None] = lambda step: time.sleep(step.seconds),
          give_back: Callable[[Reservation | None], None] = lambda booking: None) -> Outcome:
    """Run a :func:`plan`: ``ask`` the gate, ``sleep``; interrupted (any exception,
    including one of ``ask`` or the plan's own), ``give_back`` what a sleep held
    (None: nothing booked), then raise."""
    reply: Any = None
    booking: Reservation | None = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Ask):
                reply = ask(step)
            else:
                booking = step.booking
                sleep(step)
                booking, reply = None, None
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        give_back(booking)
        raise


async def adrive(steps: Generator[Ask | Sleep, Any, Outcome],
                 ask: Callable[[Ask], Awaitable[Decision]],
                 give_back: Callable[[Reservation | None], Awaitable[None]]) -> Outcome:
    """:func:`drive` for asyncio: awaits ``ask`` and ``asyncio.sleep``; cancelled, it
    gives back on a task of its own, which the cancellation cannot reach."""
    reply: Any = None
    booking: Reservation | None = None
    try:
        while True:
            step = steps.send(reply)
            if isinstance(step, Ask):
                reply = await ask(step)
            else:
                booking = step.booking
                await asyncio.sleep(step.seconds)
                booking, reply = None, None
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except BaseException:
        await asyncio.shield(give_back(booking))
        raise


def wait(gate: Gate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
         holder: str = "", grace: float = DEFAULT_GRACE) -> Decision:
    """Block until ``limits`` admit one start (booked, so waiters never herd); return it."""
    def ask(step: Ask) -> Decision:
        return gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                 grace=step.grace, holder=holder, near=step.near)

    def give_back(booking: Reservation | None) -> None:
        _give_back(gate.cancel, gate.release, limits, booking, holder)

    return drive(plan(limits, timeout, grace=grace), ask, give_back=give_back).decision


async def await_start(gate: AsyncGate, limits: Sequence[AnyLimit], *,
                     timeout: float | None = None, holder: str = "",
                     grace: float = DEFAULT_GRACE) -> Decision:
    """:func:`wait` for asyncio: the same plan, awaiting the gate and ``asyncio.sleep``."""
    async def ask(step: Ask) -> Decision:
        return await gate.acquire_many(limits, reserve=step.reserve, claim=step.claim,
                                       grace=step.grace, holder=holder, near=step.near)

    async def give_back(booking: Reservation | None) -> None:
        await _agive_back(gate, limits, booking, holder)

    outcome = await adrive(plan(limits, timeout, grace=grace), ask, give_back)
    return outcome.decision


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


@contextlib.contextmanager
def hold(gate: Gate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
         holder: str | None = None, grace: float = DEFAULT_GRACE) -> Iterator[Decision]:
    """Wait for a start, then run the block holding its concurrency seats.

    The leases are renewed by the process's heartbeat (``heartbeat.py``)
    while the block runs (so it may outlast the lease) and given back when
    it exits, however it exits.
    """
    holder = holder or uuid.uuid4().hex
    decision = wait(gate, limits, timeout=timeout, holder=holder, grace=grace)
    leases = seats_of(limits)
    if not leases:
        yield decision
        return
    held = heartbeat.hold(gate, leases, holder)  # the process's heartbeat renews them
    try:
        yield decision
    finally:
        heartbeat.stop(held)  # (a renewal under way ends first, none begins after)
        gate.release(leases, holder, ran_for=time.monotonic() - held.since)


@contextlib.asynccontextmanager
async def ahold(gate: AsyncGate, limits: Sequence[AnyLimit], *, timeout: float | None = None,
                holder: str | None = None,
                grace: float = DEFAULT_GRACE) -> AsyncIterator[Decision]:
    """:func:`hold` for asyncio: the leases are renewed by a task while the block runs."""
    holder = holder or uuid.uuid4().hex
    decision = await await_start(gate, limits, timeout=timeout, holder=holder, grace=grace)
    leases = seats_of(limits)
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
