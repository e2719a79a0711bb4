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
aggregates every child through ``MultiProcessCollector``.  Bucket fill is read
from Redis when scraped (:class:`FillCollector`), so it is the cluster's
state, not a process's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["WAIT_BUCKETS", "FillCollector", "LimitStats", "prepare", "reset", "serve",
           "snapshot"]

#: Histogram buckets (seconds) for the waits given to deferred tasks.
WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


@dataclass(slots=True)
class LimitStats:
    """One limit's counts in this process."""

    admitted: int = 0
    deferred: int = 0
    wait_seconds_sum: float = 0.0
    store_errors: int = 0


_lock = threading.Lock()  # the threads pool updates from several threads
_stats: dict[str, LimitStats] = {}
_prom: Any = None  # (admitted, deferred, waits, errors) once prometheus_client is loaded


def snapshot() -> dict[str, dict[str, float]]:
    """This process's counts per limit name: ``{name: {admitted, deferred, ...}}``."""
    with _lock:
        return {name: asdict(stats) for name, stats in sorted(_stats.items())}


def reset() -> None:
    """Forget this process's counts (tests; Prometheus counters only ever grow)."""
    with _lock:
        _stats.clear()


def admitted(names: list[str]) -> None:
    """Tasks passed every limit in ``names``."""
    _count(names, "admitted", 0)


def deferred(name: str, wait: float) -> None:
    """A task was re-scheduled by limit ``name`` to start in ``wait`` seconds."""
    with _lock:
        _stats.setdefault(name, LimitStats()).wait_seconds_sum += wait
    _count([name], "deferred", 1)
    prom = _prometheus()
    if prom is not None:
        prom[2].labels(name).observe(wait)


def store_error(names: list[str]) -> None:
    """A decision over ``names`` failed because the store did not answer."""
    _count(names, "store_errors", 3)


def _count(names: list[str], field: str, metric: int) -> None:
    """Add one to ``field`` of each limit, here and in Prometheus metric number ``metric``."""
    with _lock:
        for name in names:
            stats = _stats.setdefault(name, LimitStats())
            setattr(stats, field, getattr(stats, field) + 1)
    prom = _prometheus()
    if prom is not None:
        for name in names:
            prom[metric].labels(name).inc()


def prepare() -> None:
    """Create the Prometheus metrics now (a worker calls this before forking its pool).

    Importing prometheus_client takes tens of milliseconds: done on a task's
    first admission, it delays that start past its slot while later tasks
    start on time, which bunches starts together (measured: 7 starts in a
    0.25 s window of a 20/s limit).
    """
    _prometheus()


def _prometheus() -> Any:
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
                _prom = (
                    Counter("celery_throttle_admitted", "Tasks admitted by the throttle",
                            ["limit"]),
                    Counter("celery_throttle_deferred", "Tasks re-scheduled by a limit",
                            ["limit"]),
                    Histogram("celery_throttle_wait_seconds", "Waits given to deferred tasks",
                              ["limit"], buckets=WAIT_BUCKETS),
                    Counter("celery_throttle_store_errors", "Decisions the store failed",
                            ["limit"]),
                )
    return _prom or None


class FillCollector:
    """Prometheus collector: each un-keyed limit's bucket, read from Redis at scrape time."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        """Yield gauges of fill (units used / burst), next free slot and booked-ahead starts."""
        from prometheus_client.core import GaugeMetricFamily

        from .command import known_limits  # lazily: the command module imports Celery's CLI
        from .gate import Concurrency
        from .store import runtime_for

        fill = GaugeMetricFamily("celery_throttle_fill_ratio",
                                 "Bucket content / burst (above 1: slots booked ahead)",
                                 labels=["limit"])
        free = GaugeMetricFamily("celery_throttle_next_free_seconds",
                                 "Seconds until the limit admits a start", labels=["limit"])
        booked = GaugeMetricFamily("celery_throttle_booked_ahead",
                                   "Starts booked beyond the burst (waiting tasks)",
                                   labels=["limit"])
        held = GaugeMetricFamily("celery_throttle_leases_held",
                                 "Concurrency slots held (unexpired leases)", labels=["limit"])
        runtime = runtime_for(self.app)
        room = runtime.room.state()
        parked = GaugeMetricFamily("celery_throttle_parked",
                                   "Tasks parked in the waiting room (not yet released)")
        parked.add_metric([], room.parked)
        releasing = GaugeMetricFamily("celery_throttle_releasing",
                                      "Tasks released and not yet arrived at a worker")
        releasing.add_metric([], room.releasing)
        gate = runtime.gate
        for known in known_limits(self.app):
            lim = known.limit
            if known.keyed:
                continue
            if isinstance(lim, Concurrency):
                leases = gate.inspect_leases(lim)
                held.add_metric([lim.name], leases.held)
                continue
            state = gate.inspect(lim)
            fill.add_metric([lim.name], state.used / lim.burst)
            free.add_metric([lim.name], state.next_free)
            booked.add_metric([lim.name], state.booked_ahead)
        yield from (fill, free, booked, held, parked, releasing)


def serve(app: Celery, port: int, addr: str = "0.0.0.0") -> None:  # scraped from elsewhere
    """Serve ``/metrics`` for this worker node (every pool child, in multiprocess mode)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.multiprocess import MultiProcessCollector
    except ImportError as exc:
        raise ImportError("throttle_metrics_port needs prometheus_client: "
                          "pip install 'celery-gcra-throttle[prometheus]'") from exc
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        from prometheus_client import REGISTRY
        registry = REGISTRY
    registry.register(FillCollector(app))
    start_http_server(port, addr=addr, registry=registry)
