"""The dashboard's charts: every limit's last 15 minutes, one point per second.

Two sources, each where it is cheapest:

* what the workers did (starts, deferrals, provider 429 pauses, would-have
  deferrals of limits in shadow mode), from the
  counts they keep in the store per second (``integration/history.py``), so a
  dashboard started now charts the 15 minutes before it too;
* what waits (tasks in line and starts booked ahead), fill and pauses: state,
  not events, so the dashboard samples it (:meth:`Charts.sample`, once a
  second, from the same document ``status`` prints); it has no history before
  the dashboard started.

A page asks for the seconds after the last one it has (:meth:`Charts.since`), so
a refresh moves a few numbers, not 900 per series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from ..core.rates import parse_rate
from ..integration.history import SPAN, read_counts
from ..integration.runtime import runtime_for
from . import report

__all__ = ["SPAN", "Charts"]

# A worker adds a second's counts up to a second after it (its writer's
# period) plus the clock difference between machines: seconds this recent are
# read again at each refresh.
_UNSETTLED = 5


class Charts:
    """The per-second series of every limit of ``app``, for the last :data:`SPAN` seconds."""

    def __init__(self, app: Celery, *, span: int = SPAN,
                 clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.span = span
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: dict[int, dict[str, dict[str, float]]] = {}
        self._sampled: dict[int, dict[str, dict[str, float]]] = {}
        self._read_up_to: int | None = None

    def sample(self) -> dict[str, Any]:
        """Read every limit's state now (the ``status`` document, returned) and keep the
        figures charted: tasks waiting, fill, paused, the rate in force."""
        doc = report.status(self.app)
        second = int(doc["at"])
        point: dict[str, dict[str, float]] = {}
        for row in doc["limits"]:
            if "rate" in row:
                waiting = row.get("in_line", 0) + row.get("booked_ahead", 0)
                per_s = 1_000_000 / parse_rate(row["rate"]).interval_us
                point[row["limit"]] = {"waiting": waiting, "fill": row.get("fill", 0.0),
                                       "paused": 1.0 if row.get("paused_s") else 0.0,
                                       "limit_per_s": round(per_s, 6)}
            elif "held" in row:
                point[row["limit"]] = {"waiting": 0, "fill": row["held"] / row["concurrency"],
                                       "paused": 1.0 if row.get("paused_s") else 0.0}
        with self._lock:
            self._sampled[second] = point
            for old in [s for s in self._sampled if s <= second - self.span]:
                del self._sampled[old]
        return doc

    def since(self, after: int | None) -> dict[str, Any]:
        """The seconds after ``after`` (all :data:`SPAN` when None, or when older), and the
        last :data:`_UNSETTLED` seconds again (their counts may still grow).

        ``{"from": s0, "to": s1, "limits": {name: {series: [one value per second]}}}``:
        series ``admitted``, ``deferred``, ``provider_pauses``, ``would_defer`` (shadow
        mode) (counts), ``waiting``,
        ``fill``, ``paused``, ``limit_per_s`` (sampled; None where no sample was taken).
        """
        now = int(self.clock())
        first = now - self.span + 1
        if after is not None:
            first = max(first, after + 1 - _UNSETTLED)
        self._refresh_counts(now)
        seconds = range(first, now + 1)
        with self._lock:
            names = sorted({n for s in seconds for n in self._counts.get(s, {})}
                           | {n for s in seconds for n in self._sampled.get(s, {})})
            limits = {}
            for name in names:
                series: dict[str, list[float | None]] = {}
                for field in ("admitted", "deferred", "provider_pauses", "would_defer"):
                    series[field] = [self._counts.get(s, {}).get(name, {}).get(field, 0.0)
                                     for s in seconds]
                for field in ("waiting", "fill", "paused", "limit_per_s"):
                    series[field] = [self._sampled.get(s, {}).get(name, {}).get(field)
                                     for s in seconds]
                limits[name] = series
        return {"from": first, "to": now, "limits": limits}

    def _refresh_counts(self, now: int) -> None:
        """Read the seconds not read yet, and the unsettled ones again."""
        with self._lock:
            start = now - self.span + 1 if self._read_up_to is None else \
                max(now - self.span + 1, self._read_up_to + 1 - _UNSETTLED)
        runtime = runtime_for(self.app)
        fresh = read_counts(runtime.gate.client, runtime.config.prefix, range(start, now + 1))
        with self._lock:
            for second in range(start, now + 1):
                if second in fresh:
                    self._counts[second] = fresh[second]
                else:
                    self._counts.pop(second, None)
            for old in [s for s in self._counts if s <= now - self.span]:
                del self._counts[old]
            self._read_up_to = now

