"""The checks of plain values every layer takes: counts, units and a start's cost.

The bottom layer with rates, keys and errors: it imports nothing from the
package, so the gate, the decorator and the settlements check the same rule
from one place.
"""

from __future__ import annotations

import math

__all__ = ["check_cost", "positive_int", "to_us", "units"]


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


def to_us(seconds: float) -> int:
    """A duration in whole microseconds (rounded up), for the scripts; >= 0 or a ValueError."""
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"invalid duration {seconds!r}: expected seconds >= 0")
    return math.ceil(seconds * 1_000_000)
