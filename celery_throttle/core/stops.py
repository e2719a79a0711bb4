"""A limit stopped until it is resumed, and why: one record per limit, seen by every process.

A provider that says the account's money is spent (``answers.py``) stops the
limits of the call.  The stop is a pause (the one every decision reads,
``bucket.lua``) for :data:`~celery_throttle.values.LONGEST_WAIT`, so nothing is
admitted and nothing is sent, plus a record of why in one hash per prefix,
``{<prefix>}:stops`` (field: the limit's key digest and name,
``keys.stop_field``; value: :class:`Stop` as JSON).  The record is what
``celery throttle status`` shows (also for a limit that only gated clients use
and no task declares: it carries the rate to resume it with), what a gated
client raises as :class:`~celery_throttle.LimitStopped` without sending, and
what ``celery throttle resume`` clears with the pause.  A record past its
``until`` is stale (its pause has ended) and is read as none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..values import LONGEST_WAIT, text
from .limits import AnyLimit, Limit
from .rates import parse_rate

__all__ = ["MAX_MESSAGE", "Stop", "dumps", "first", "limit_of", "parse", "record"]

#: The most of a provider's message a record keeps (characters).
MAX_MESSAGE = 300


@dataclass(frozen=True, slots=True)
class Stop:
    """Why limit ``limit`` (a per-key one's value: ``per_key``, never the value itself) is
    stopped: ``reason`` ("money"), the provider's ``message``, since ``at`` until ``until``
    (unix seconds), and its ``rate`` and ``burst`` when it was stopped (to resume it)."""

    limit: str
    per_key: bool
    reason: str
    message: str
    rate: str
    burst: int
    at: float
    until: float


def record(limit: AnyLimit, reason: str, message: str, now: float | None = None) -> Stop:
    """The stop of ``limit`` for ``reason`` with the provider's ``message``, from now."""
    at = time.time() if now is None else now
    rate, burst = (limit.rate.text, limit.burst) if isinstance(limit, Limit) else ("", 0)
    return Stop(limit.name, limit.key is not None, reason, message[:MAX_MESSAGE], rate, burst,
                at, at + LONGEST_WAIT)


def limit_of(stop: Stop, key: object = None) -> Limit | None:
    """The rate limit ``stop`` names, at the rate it had when stopped (for key value ``key``
    of a per-key one); None when its record has no rate (a concurrency limit)."""
    if not stop.rate:
        return None
    return Limit(stop.limit, parse_rate(stop.rate), max(stop.burst, 1),
                 key if stop.per_key else None)


def parse(raw: bytes | str | None, now: float | None = None) -> Stop | None:
    """A record as stored, None when absent, unreadable or stale (past its ``until``)."""
    if raw is None:
        return None
    try:
        found = json.loads(text(raw))
        stop = Stop(str(found["limit"]), bool(found["per_key"]), str(found["reason"]),
                    str(found["message"]), str(found["rate"]), int(found["burst"]),
                    float(found["at"]), float(found["until"]))
    except (ValueError, KeyError, TypeError):
        return None
    return stop if stop.until > (time.time() if now is None else now) else None


def dumps(stop: Stop) -> str:
    """A record as stored."""
    return json.dumps(asdict(stop), separators=(",", ":"))


def first(raws: Sequence[bytes | str | None]) -> Stop | None:
    """The first live record among ``raws`` (an HMGET's reply), None without one."""
    return next((stop for stop in map(parse, raws) if stop is not None), None)
