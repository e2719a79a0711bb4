"""What a waiting task carries between its hops: :class:`WaitState`, in one message header.

A deferred task is re-published (or parked and dispatched) under the same id,
queue, routing, headers and options; what it needs on its next arrival (its
booked start, its deferral count, which copy it is) travels in the header
:data:`HEADER`, read back with :meth:`WaitState.from_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core.limits import AnyLimit, Reservation

__all__ = ["HEADER", "START", "STARTED", "WaitState", "spacing_of"]

#: The message header carrying a waiting task's state between hops.
HEADER = "celery_throttle"
#: The header's field of the booked start, as 0.1.0 named it (its messages may be in flight).
START = "slot"
#: The field of the start a task was admitted for, written as it starts, as 0.1.0 named it.
STARTED = "started_slot"


@dataclass(frozen=True, slots=True)
class WaitState:
    """What a deferred message carries: its booked start, deferral count and first wait."""

    start: int | None = None  # booked start, server clock, microseconds
    booked: int = 0  # the limits the start is booked in (Reservation.booked)
    epoch: int = 0  # the store lifetime the start was booked in (Reservation.epoch)
    shift: int = 0  # the booked limits' settlement shift at booking (Reservation.shift)
    deferrals: int = 0
    since: int | None = None  # server clock (us) of the first deferral
    copy: str = ""  # set by every re-publish: tells a duplicate from a redelivery
    prev: str = ""  # the copy that published this one ("-": the user's message)
    spacing: tuple[int, ...] = ()  # each limit's interval (us) when the start was booked
    entry: str = ""  # the waiting-room entry this copy was dispatched from (parking.py)
    token: str = ""  # the dispatch that published this copy (set by the dispatcher)
    room: int = 0  # the store's epoch when it was dispatched (set by the dispatcher)
    # Dispatched from a limit's line (lines.py): "c" its limits were charged
    # for it, "t" its max_wait passed, "x" uncharged (revoked or expired).
    charged: str = ""
    # Re-published while the store was down: the copy pointer (copies.py) was
    # not moved to this copy, and ``prev`` names the last copy it knows.
    unmoved: bool = False
    # Waiting, its message is also kept on the broker's server (room/keeper.py):
    # its arrival takes that copy there.
    kept: bool = False
    # Run again after its node died mid-run (WaitState.uncharged): waits for a start of
    # its own, which ``celery throttle why`` says.
    rerun: bool = False
    # How long its node's consumer held this copy before the pool got it (us;
    # integration/arrival.py): left out of the trip its arrival measures.
    # Carried by this hop only: never written into a copy's header.
    held: int = 0

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
        return cls(start=num(START) or None, booked=num("booked"), epoch=num("epoch"),
                   shift=num("shift"), deferrals=num("deferrals"),
                   since=num("since") or None, copy=text("copy"),
                   prev=text("prev"), spacing=tuple(spacing), entry=text("entry", 64),
                   token=text("token", 40), room=num("room"), charged=text("charged", 1),
                   unmoved=num("unmoved") == 1, kept=num("kept") == 1, held=num("held"),
                   rerun=num("rerun") == 1)

    def successor(self, copy: str, limits: Sequence[AnyLimit], since: int | None,
                  booking: Reservation | None = None) -> WaitState:
        """The copy ``copy`` that goes on waiting after this one (deferred once more), for
        ``limits``, first waiting at ``since`` (server clock, us), booked for ``booking``'s
        start if any.  The copy pointer moves to it from this copy."""
        return WaitState(start=booking.start if booking else None,
                         booked=booking.booked if booking else 0,
                         epoch=booking.epoch if booking else 0,
                         shift=booking.shift if booking else 0, deferrals=self.deferrals + 1,
                         since=since, copy=copy, prev=self.copy_id, spacing=spacing_of(limits),
                         rerun=self.rerun)

    def uncharged(self) -> WaitState:
        """This copy run again after its node died mid-run (the broker's redelivery of an
        acks_late message): the start it carries (booked, or charged in its line) was
        spent by the run the crash cut off, which may have called the provider already.
        So it carries none, and asks for a start as a new call does."""
        return replace(self, start=None, booked=0, epoch=0, shift=0, spacing=(), charged="",
                       rerun=True)

    def unmoved_successor(self, copy: str) -> WaitState:
        """The copy ``copy`` that re-publishes this one while the store is down.

        The pointer cannot be moved to it, so it names as predecessor the last
        copy the pointer knows, however many such hops came before: a second
        hop naming the first (which the pointer never knew) would be refused
        once the store is back, and the task lost.
        """
        return replace(self, deferrals=self.deferrals + 1, copy=copy,
                       prev=self.prev if self.unmoved else self.copy_id, unmoved=True)

    @property
    def copy_id(self) -> str:
        """This copy's id as the copy pointer knows it ("-": the message the user sent)."""
        return self.copy or "-"

    @property
    def claim(self) -> Reservation | None:
        """The reservation to claim on arrival, if any."""
        return (Reservation(start=self.start, booked=self.booked, epoch=self.epoch,
                            shift=self.shift) if self.start
                else None)

    def claim_under(self, limits: list[AnyLimit]) -> Reservation | None:
        """The booking, unless a limit is now slower than when it was booked.

        Booked starts are spaced at the old interval; honouring them after a
        rate was lowered (workers restarted with a new rate) would run the
        waiting tasks at the old, faster pace.  So they book again.
        """
        if not self.booked:
            # Nothing booked (a concurrency wait): nothing to claim; it asks
            # afresh, whether it comes back at its paced time or was handed
            # a freed seat early.
            return None
        now = spacing_of(limits)
        if len(now) != len(self.spacing) or any(
                new > old for new, old in zip(now, self.spacing, strict=True)):
            return None
        return self.claim

    def to_header(self) -> dict[str, int | str | list[int] | None]:
        """The header value (JSON-safe)."""
        header: dict[str, int | str | list[int] | None] = {
            START: self.start, "booked": self.booked, "epoch": self.epoch,
            "shift": self.shift, "deferrals": self.deferrals, "since": self.since,
            "copy": self.copy,
            "prev": self.prev, "spacing": list(self.spacing)}
        if self.unmoved:
            header.update(unmoved=1)
        if self.rerun:
            header.update(rerun=1)
        if self.entry:
            header.update(entry=self.entry, token=self.token, room=self.room)
            if self.charged:
                header.update(charged=self.charged)
            if self.kept:
                header.update(kept=1)
        return header


def spacing_of(limits: Sequence[AnyLimit]) -> tuple[int, ...]:
    """Each limit's interval (us; 0 for a concurrency limit), carried with a booking."""
    return tuple(lim.interval_us for lim in limits)
