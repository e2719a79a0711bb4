"""What the throttle did, per limit: counters in this process, and Prometheus when installed.

Every worker process counts its own decisions (:func:`snapshot` reads them):
tasks admitted, deferrals, the waits they were given, and store errors, per
limit *name*.  Key values never become labels: they may be secrets and their
number is unbounded; a keyed limit is counted under its name (per-key state
is one ``celery throttle status NAME --key K`` away).

With ``prometheus_client`` installed (``pip install celery-gcra-throttle[prometheus]``)
the same counts also go to its default registry.  A prefork pool has one
registry per child: run the worker with ``PROMETHEUS_MULTIPROC_DIR`` set to an
empty directory, and the endpoint the worker serves (``throttle_metrics_port``)
aggregates every child through ``MultiProcessCollector``.  The endpoint and
the gauges read from Redis at scrape time live in ``integration/exporter.py``.

Once :func:`keep_seconds` is on (a worker's history writer, ``integration/history.py``,
turns it on), the same counts are also kept per wall-clock second for the writer to
take (:func:`take_seconds`) and add to the store, where the dashboard charts them.
This module imports nothing from the package: every layer may count.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

__all__ = ["KEPT_SECONDS", "WAIT_BUCKETS", "LimitStats", "keep_seconds", "prepare", "reset",
           "snapshot", "take_seconds"]

#: The most seconds of counts kept for :func:`take_seconds` (older ones are dropped:
#: nobody took them, and the dashboard charts 15 minutes).
KEPT_SECONDS = 960

#: Histogram buckets (seconds) for the waits given to deferred tasks.
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(slots=True)
class LimitStats:
    """One limit's counts in this process."""

    admitted: int = 0
    deferred: int = 0
    wait_seconds_sum: float = 0.0
    store_errors: int = 0
    provider_pauses: int = 0
    would_defer: int = 0  # shadow mode: tasks the limit would have made wait
    would_wait_seconds_sum: float = 0.0


class _Prometheus(NamedTuple):
    """The Prometheus metrics, by the LimitStats field each one mirrors."""

    admitted: Any  # Counter
    deferred: Any  # Counter
    waits: Any  # Histogram
    store_errors: Any  # Counter
    provider_pauses: Any  # Counter
    would_defer: Any  # Counter
    would_waits: Any  # Histogram


# This module's state, all of it: the counts, their lock, the Prometheus metrics.
_lock = threading.Lock()  # the threads pool updates from several threads
_stats: dict[str, LimitStats] = {}
_prom: _Prometheus | bool | None = None  # False: prometheus_client is not installed
_wall = time.time  # the second a count is filed under (tests replace it)
# Counts per wall-clock second, {second: {(field, limit): n}}, once keep_seconds(True).
_seconds: dict[int, dict[tuple[str, str], float]] | None = None


def _after_fork_in_child() -> None:
    """A forked process counts its own decisions: its parent's counts stay the parent's.

    A worker's main process counts too (tasks lined up on arrival,
    ``integration/arrival.py``) and forks pool processes, again and again
    where they are recycled: a child that kept the counts its parent had not
    yet written would have its writer add them a second time.  The lock is
    new too: another of the parent's threads may have held it at the fork.
    """
    global _lock, _seconds
    _lock = threading.Lock()
    _stats.clear()
    if _seconds is not None:
        _seconds = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


def keep_seconds(on: bool) -> None:
    """Keep (or stop keeping) the counts per second for :func:`take_seconds`."""
    global _seconds
    with _lock:
        _seconds = ({} if _seconds is None else _seconds) if on else None


def take_seconds() -> dict[int, dict[tuple[str, str], float]]:
    """The counts per second since the last call, ``{unix second: {(field, limit): n}}``."""
    global _seconds
    with _lock:
        if not _seconds:
            return {}
        taken, _seconds = _seconds, {}
    return taken


def _add_to_second(name: str, field: str, amount: float) -> None:
    """(Under ``_lock``.)  Count ``amount`` in this second's ``field`` of limit ``name``."""
    if _seconds is None:
        return
    second = int(_wall())
    counts = _seconds.get(second)
    if counts is None:
        counts = _seconds[second] = {}
        if len(_seconds) > KEPT_SECONDS:
            del _seconds[min(_seconds)]
    counts[field, name] = counts.get((field, name), 0) + amount


def snapshot() -> dict[str, dict[str, float]]:
    """This process's counts per limit name: ``{name: {admitted, deferred, ...}}``."""
    with _lock:
        return {name: asdict(stats) for name, stats in sorted(_stats.items())}


def reset() -> None:
    """Forget this process's counts (tests; Prometheus counters only ever grow)."""
    with _lock:
        _stats.clear()
        if _seconds is not None:
            _seconds.clear()


def admitted(names: list[str]) -> None:
    """Tasks passed every limit in ``names``."""
    _count(names, "admitted")


def deferred(name: str, wait: float) -> None:
    """A task was re-scheduled by limit ``name`` to start in ``wait`` seconds."""
    _wait(name, wait, "deferred", "wait_seconds_sum", "waits")


def would_defer(name: str, wait: float) -> None:
    """Shadow mode: limit ``name`` would have made a task wait ``wait`` seconds (it ran)."""
    _wait(name, wait, "would_defer", "would_wait_seconds_sum", "would_waits")


def _wait(name: str, wait: float, field: str, sum_field: str, histogram: str) -> None:
    """Count a wait given (or that would have been) by limit ``name``: one in ``field``,
    ``wait`` added to ``sum_field``, observed in the Prometheus ``histogram``."""
    with _lock:
        stats = _stats.setdefault(name, LimitStats())
        setattr(stats, sum_field, getattr(stats, sum_field) + wait)
        _add_to_second(name, sum_field, wait)
    _count([name], field)
    prom = _prometheus()
    if prom is not None:
        getattr(prom, histogram).labels(name).observe(wait)


def store_error(names: list[str]) -> None:
    """A decision over ``names`` failed because the store did not answer."""
    _count(names, "store_errors")


def provider_paused(names: list[str]) -> None:
    """A provider refused a call (429): the limits ``names`` were paused on every worker."""
    _count(names, "provider_pauses")


def _count(names: list[str], field: str) -> None:
    """Add one to ``field`` of each limit, here and in the Prometheus metric of that name."""
    with _lock:
        for name in names:
            stats = _stats.setdefault(name, LimitStats())
            setattr(stats, field, getattr(stats, field) + 1)
            _add_to_second(name, field, 1)
    prom = _prometheus()
    if prom is not None:
        for name in names:
            getattr(prom, field).labels(name).inc()


def prepare() -> None:
    """Create the Prometheus metrics now (a worker calls this before forking its pool).

    Importing prometheus_client takes tens of milliseconds: done on a task's
    first admission, it delays that start past its booked start while later tasks
    start on time, which bunches starts together.
    """
    _prometheus()


def _prometheus() -> _Prometheus | None:
    """The Prometheus metrics, created on first use; None without prometheus_client."""
    global _prom
    if _prom is None:
        try:
            from prometheus_client import Counter, Histogram
        except ImportError:
            _prom = False
            return None
        with _lock:
            if _prom is None:
                _prom = _Prometheus(
                    admitted=Counter("celery_throttle_admitted",
                                     "Tasks admitted by the throttle", ["limit"]),
                    deferred=Counter("celery_throttle_deferred",
                                     "Tasks re-scheduled by a limit", ["limit"]),
                    waits=Histogram("celery_throttle_wait_seconds",
                                    "Waits given to deferred tasks", ["limit"],
                                    buckets=WAIT_BUCKETS),
                    store_errors=Counter("celery_throttle_store_errors",
                                         "Decisions the store failed", ["limit"]),
                    provider_pauses=Counter("celery_throttle_provider_pauses",
                                            "Provider refusals (429) that paused the limit "
                                            "on every worker", ["limit"]),
                    would_defer=Counter("celery_throttle_shadow_deferred",
                                        "Shadow mode: tasks the limit would have made wait "
                                        "(they ran at once)", ["limit"]),
                    would_waits=Histogram("celery_throttle_shadow_wait_seconds",
                                          "Shadow mode: the waits the limit would have given",
                                          ["limit"], buckets=WAIT_BUCKETS),
                )
    return _prom if isinstance(_prom, _Prometheus) else None
