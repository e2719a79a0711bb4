"""Starts a run was admitted for and has not yet spent on a request.

A Celery task admitted under a limit (``@throttled``) was charged one start
of it.  When the task's first HTTP request then goes through a gated
transport (``celery_throttle.transport``) under the same limit, charging it
again would halve the limit's pace: the transport spends the admission
instead.  The admission is kept here, for the run's thread or coroutine
(a context variable the Celery side sets around each run), by bucket key:
two limits with the same name and key value are one bucket, whoever
declared them.

An admission spent at once is the start the gate admitted.  One spent late
(a client built lazily, work before the call) would bunch with the starts
admitted after it, so the transport gives a stale one back
(:meth:`Gate.settle` to nothing) and waits for a fresh start.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass

from .limits import Limit

__all__ = ["Admission", "grant", "revoke", "take"]


@dataclass(frozen=True, slots=True)
class Admission:
    """One start of ``limit`` admitted at ``at`` (``time.monotonic()``), not yet spent."""

    limit: Limit
    at: float

    def fresh(self, within: float, clock: float | None = None) -> bool:
        """Whether a request sent now is still the start that was admitted."""
        return (time.monotonic() if clock is None else clock) - self.at <= within


_unspent: ContextVar[dict[str, Admission] | None] = ContextVar(
    "celery_throttle_unspent", default=None)


def grant(admitted: dict[str, Admission]) -> Token[dict[str, Admission] | None]:
    """Record the starts a run was admitted for (bucket key -> admission) until :func:`revoke`."""
    return _unspent.set(dict(admitted))


def revoke(token: Token[dict[str, Admission] | None]) -> None:
    """The run ended: forget what it did not spend."""
    _unspent.reset(token)


def take(keys: Iterable[str]) -> dict[str, Admission]:
    """Spend the unspent admissions of the buckets ``keys`` (each at most once)."""
    unspent = _unspent.get()
    if not unspent:
        return {}
    return {key: unspent.pop(key) for key in list(keys) if key in unspent}
