"""What a provider's rate-limit headers say is left of its quota.

OpenAI and Anthropic send, on every answer, how much of each quota is left
and when it is full again (both refill continuously, as a token bucket):

* OpenAI: ``x-ratelimit-remaining-requests`` / ``-tokens`` and
  ``x-ratelimit-reset-requests`` / ``-tokens`` as a duration (``"6m0s"``,
  ``"1s"``, ``"293ms"``);
* Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,
  output-tokens}-remaining`` and ``-reset`` as an RFC 3339 time
  (remaining tokens are rounded to thousands by the provider).

:func:`reports_of` reads them all into :class:`Report` values; a header
that cannot be read is left out (a provider's format change must not fail
the call that carried it), and so is one that says nothing: a negative
count or limit, or a reset that is not ahead (Azure OpenAI's ``-1`` and
``0``), is unknown, never "nothing left".
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "Report", "duration", "reports_of"]

#: The quotas a report may be about.
KINDS = ("requests", "tokens", "input-tokens", "output-tokens")
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?"
                       r"(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")


@dataclass(frozen=True, slots=True)
class Report:
    """``remaining`` units of quota ``kind`` are left; it is full again in ``reset`` seconds."""

    kind: str
    remaining: int
    reset: float


def duration(text: str) -> float:
    """OpenAI's reset durations in seconds: ``"6m0s"`` 360, ``"1.5s"``, ``"293ms"`` 0.293.

    A bare number is seconds.  Raises ValueError naming the text otherwise.
    """
    text = text.strip()
    with contextlib.suppress(ValueError):
        return max(0.0, float(text))
    found = _DURATION.fullmatch(text)
    if not text or found is None or not any(found.groups()):
        raise ValueError(f"unreadable duration {text!r}")
    h, m, s, ms = (float(g) if g else 0.0 for g in found.groups())
    return h * 3600 + m * 60 + s + ms / 1000


def _until(text: str) -> float:
    """Seconds from now until an RFC 3339 time (Anthropic's resets)."""
    when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (when - dt.datetime.now(dt.timezone.utc)).total_seconds())


def reports_of(headers: Any) -> list[Report]:
    """Every quota report in ``headers`` (a mapping with ``get``: httpx's and requests'
    headers match names in any case, a plain dict needs them in lower case)."""
    found: list[Report] = []
    for kind in KINDS:
        for prefix, suffix, read in (("x-ratelimit-", f"-{kind}", duration),
                                     (f"anthropic-ratelimit-{kind}-", "", _until)):
            left, reset = headers.get(f"{prefix}remaining{suffix}"), \
                headers.get(f"{prefix}reset{suffix}")
            if left is None or reset is None:
                continue
            with contextlib.suppress(TypeError, ValueError):
                remaining, seconds = int(float(left)), read(str(reset))
                limit = headers.get(f"{prefix}limit{suffix}")
                # Unknown is not zero: Azure OpenAI answers -1 for the limit and
                # what remains, and 0 for the reset, when it does not say.
                if remaining >= 0 and seconds > 0 and (limit is None or float(limit) >= 0):
                    found.append(Report(kind, remaining, seconds))
    return found
