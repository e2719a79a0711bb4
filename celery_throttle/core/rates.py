"""What a rate is: ``N/P`` parsed once into an immutable :class:`Rate`.

The grammar is Celery's (``"10/s"``, ``"100/m"``, ``"2/h"``, ``"0.5/s"``) plus
days and a period multiple (``"1000/d"``, ``"5/10s"``, ``"90000/m"``).  A bare
number (Celery's "per second" shorthand) is refused: for a paid quota the
period must be written down.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from ..values import US_PER_SECOND

__all__ = ["Rate", "parse_rate"]

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_FORM = re.compile(
    r"""^\s*
    (?P<count>\d+(?:\.\d+)?|\.\d+)      # how many starts: 10, 0.5, .5
    \s*/\s*
    (?P<mult>\d+)?                      # optional period multiple: 5/10s
    \s*(?P<unit>[smhd])\s*$""",
    re.VERBOSE,
)
_EXPECTED = "expected 'N/P' such as '10/s', '100/m', '2/h', '1000/d', '0.5/s' or '5/10s'"

# Microseconds are the unit across the Lua boundary (values.US_PER_SECOND):
# Redis' TIME gives them, and an interval of 1 us still represents 1,000,000
# starts per second.


@dataclass(frozen=True, slots=True)
class Rate:
    """``count`` starts per ``period`` seconds (both exact, ``count`` may be fractional)."""

    count: Fraction
    period: int
    text: str

    def __repr__(self) -> str:
        return f"Rate({self.text!r})"

    def __str__(self) -> str:
        return self.text

    @property
    def per_second(self) -> float:
        """Starts per second."""
        return float(self.count / self.period)

    @property
    def interval(self) -> float:
        """Seconds between starts (the emission interval, GCRA's T)."""
        return float(self.period / self.count)

    @property
    def interval_us(self) -> int:
        """The emission interval in whole microseconds, rounded *up*.

        Rounding up can only make the limit stricter, never let one more start
        through; at 90000/m the loss is below one start per 100 minutes.
        """
        return max(1, math.ceil(self.period * US_PER_SECOND / self.count))


def parse_rate(value: object) -> Rate:
    """Parse ``value`` into a :class:`Rate`; a :class:`Rate` is returned as is.

    Raises :class:`ValueError` naming the value and showing the expected form.
    """
    if isinstance(value, Rate):
        return value
    if not isinstance(value, str):
        raise ValueError(f"invalid rate {value!r}: {_EXPECTED}")
    match = _FORM.match(value)
    if match is None:
        raise ValueError(f"invalid rate {value!r}: {_EXPECTED}")
    count = Fraction(match["count"])
    mult = int(match["mult"]) if match["mult"] is not None else 1
    if count <= 0:
        raise ValueError(f"invalid rate {value!r}: the count must be greater than 0 ({_EXPECTED})")
    if mult <= 0:
        raise ValueError(
            f"invalid rate {value!r}: the period multiple must be greater than 0 ({_EXPECTED})"
        )
    text = value.strip().replace(" ", "")
    return Rate(count=count, period=mult * _UNIT_SECONDS[match["unit"]], text=text)
