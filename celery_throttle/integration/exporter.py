"""The Prometheus endpoint of a worker node, and the gauges it reads from Redis when scraped.

Imported by the worker only (``throttle_metrics_port``).  Counters are
``metrics.py``'s; here: each un-keyed limit's fill, next free start,
booked-ahead starts and pause left, leases held, the waiting room's counts, and each
limit's tasks in line with an estimate of when its line drains, read at
scrape time, so they are the cluster's state, not a process's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from celery import Celery

from ..core import learners
from ..core.limits import Concurrency, Limit
from .declared import known_limits
from .runtime import runtime_for

__all__ = ["FillCollector", "serve"]


class FillCollector:
    """Prometheus collector: each un-keyed limit's bucket, read from Redis at scrape time."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        """Yield gauges of fill (units used / burst), next free start and booked-ahead starts."""
        from prometheus_client.core import GaugeMetricFamily

        fill = GaugeMetricFamily("celery_throttle_fill_ratio",
                                 "Bucket content / burst (above 1: starts booked ahead)",
                                 labels=["limit"])
        free = GaugeMetricFamily("celery_throttle_next_free_seconds",
                                 "Seconds until the limit admits a start", labels=["limit"])
        booked = GaugeMetricFamily("celery_throttle_booked_ahead",
                                   "Starts booked beyond the burst (waiting tasks)",
                                   labels=["limit"])
        held = GaugeMetricFamily("celery_throttle_leases_held",
                                 "Concurrency seats held (unexpired leases)", labels=["limit"])
        paused = GaugeMetricFamily("celery_throttle_paused_seconds",
                                   "Seconds until the limit's pause ends (a provider's 429 or "
                                   "throttle pause; 0: not paused)", labels=["limit"])
        runtime = runtime_for(self.app)
        room = runtime.room.state()
        parked = GaugeMetricFamily("celery_throttle_parked",
                                   "Tasks parked in the waiting room (not yet dispatched)")
        parked.add_metric([], room.parked)
        dispatching = GaugeMetricFamily("celery_throttle_dispatching",
                                      "Tasks dispatched and not yet arrived at a worker")
        dispatching.add_metric([], room.dispatching)
        in_line = GaugeMetricFamily("celery_throttle_in_line",
                                    "Tasks waiting in line for the limit (every key value)",
                                    labels=["limit"])
        drains = GaugeMetricFamily("celery_throttle_drain_seconds",
                                   "Estimated seconds until the limit's line is empty at its "
                                   "current rate", labels=["limit"])
        learned = GaugeMetricFamily("celery_throttle_learned_rate",
                                    "Starts a second a limit that learns its provider's quota "
                                    "decides at now (at most its rate)", labels=["limit"])
        known_all = known_limits(self.app)
        rates = runtime.live.apply([k.limit for k in known_all if isinstance(k.limit, Limit)])
        for line in runtime.room.lines.busiest(
                {lim.name: lim.interval_us for lim in rates}):
            in_line.add_metric([line.name], line.waiting)
            if line.drains_in is not None:
                drains.add_metric([line.name], line.drains_in)
        gate = runtime.gate
        for known in known_all:
            lim = known.limit
            if known.keyed:
                continue
            if isinstance(lim, Concurrency):
                leases = gate.inspect_leases(lim)
                held.add_metric([lim.name], leases.held)
                paused.add_metric([lim.name], leases.paused)
                continue
            state = gate.inspect(lim)
            if state.learned is not None:
                learned.add_metric([lim.name], state.learned.rate)
            paused.add_metric([lim.name], state.paused)
            fill.add_metric([lim.name], state.used / lim.burst)
            free.add_metric([lim.name], state.next_free)
            booked.add_metric([lim.name], state.booked_ahead)
        declared_names = {k.limit.name for k in known_all}
        for lim, per_key in learners.read(gate.client, gate.prefix):
            learnt = None if per_key or lim.name in declared_names else gate.inspect(lim).learned
            if learnt is not None:  # (a gated client's, no task declares it)
                learned.add_metric([lim.name], learnt.rate)
        stopped = GaugeMetricFamily(
            "celery_throttle_stopped",
            "1 while the limit is stopped until resumed (reason: money, a provider said the "
            "account's money is spent); declared or not, shared limits",
            labels=["limit", "reason"])
        for stop in gate.stops():
            if not stop.per_key:
                stopped.add_metric([stop.limit, stop.reason], 1)
        yield from (fill, free, booked, held, paused, parked, dispatching, in_line, drains,
                    stopped, learned)


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
