"""The checks of plain values every layer takes: counts, durations, units and a start's cost.

A leaf with the errors: it imports nothing from the package, so the gate,
the decorator, the settings and the exceptions check each rule from one
place.  Durations cross into the scripts as whole microseconds.
"""

from __future__ import annotations

import math

__all__ = ["LONGEST_WAIT", "US_PER_SECOND", "check_cost", "from_us", "positive_int",
           "renew_every", "seconds", "text", "to_us", "units"]

US_PER_SECOND = 1_000_000

#: The longest a start is booked ahead (and a waiter with no timeout waits at a
#: time): a week.  A booking is a few bytes in Redis, not a worker's memory.
LONGEST_WAIT = 7 * 24 * 3600.0


def text(value: object) -> str:
    """A value as Redis replies it (bytes, or str with ``decode_responses``) as a str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def positive_int(what: str, value: object) -> int:
    """``value`` if it is an integer >= 1 (not a bool); else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"invalid {what} {value!r}: expected an integer >= 1")
    return value


def units(what: str, value: object) -> int:
    """A settled cost: an integer >= 0 (a call may have used nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"invalid {what} {value!r}: expected an integer >= 0")
    return value


def seconds(what: str, value: object) -> float:
    """A duration: a number >= 0 (not a bool, not NaN); else a ValueError naming ``what``."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
            or value < 0):
        raise ValueError(f"invalid {what} {value!r}: expected seconds >= 0")
    return float(value)


def check_cost(cost: object, burst: int, limit: str | None = None) -> int:
    """The cost of one start: an integer from 1 to the ``burst`` of ``limit``.

    The one home of "cost <= burst", checked where ``@throttled`` declares a
    limit and where a :class:`~celery_throttle.Limit` is made (which is where a
    computed cost is checked): a bucket never holds more than its burst, so a
    larger cost could never pass and is refused with an error instead of
    waiting forever.
    """
    value = positive_int("cost", cost)
    if value > burst:
        of = f" of limit {limit!r}" if limit is not None else ""
        raise ValueError(f"cost {value} exceeds burst {burst}{of}: it could never pass; "
                         "raise the burst or split the job")
    return value


def to_us(duration: float) -> int:
    """A duration in whole microseconds (rounded up), for the scripts; >= 0 or a ValueError."""
    return math.ceil(seconds("duration", duration) * US_PER_SECOND)


def from_us(us: int) -> float:
    """Microseconds (a script's reply, a server clock difference) in seconds."""
    return us / US_PER_SECOND


def renew_every(leases: list[float]) -> float:
    """How often leases of these lengths (seconds) are renewed: every third of the shortest,
    so a lease outlives two missed renewals."""
    return min(leases) / 3
