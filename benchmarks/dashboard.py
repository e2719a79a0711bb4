"""What the dashboard and its history cost: per decision, per worker process, per refresh.

    python -m benchmarks.dashboard [--decisions 200000] [--keys 10000]

No workers.  Three tables, each measured side by side in this run:

* per decision: a worker's count of an admission (``metrics.admitted``)
  with the per-second counts off and on (what the history adds to a
  decision's path), next to one real gate decision on this machine's Redis
  for scale;
* per busy worker process per second: one ``CountsWriter.write`` of a
  second's counts for 1, 10 and 100 limits (what the history adds to the
  store);
* per dashboard refresh: ``/api/status`` (``report.status``) and
  ``/api/history`` with one per-key limit whose waiting tasks are spread over
  0, 1,000 and ``--keys`` key values (``Lines.enqueue``, as a worker puts
  them), each refresh timed as the dashboard's sampler and page ask for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import redis
from celery import Celery

from celery_throttle import metrics, throttled
from celery_throttle.core.gate import Gate
from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.integration.history import CountsWriter
from celery_throttle.integration.runtime import forget
from celery_throttle.ops import report
from celery_throttle.ops.charts import Charts
from celery_throttle.room.lines import Lines
from celery_throttle.testing import RedisServer

ROUNDS = 5


def per_decision(url: str, n: int) -> list[tuple[str, float]]:
    """Microseconds per counted admission, history off and on (alternating rounds), and per
    gate decision."""
    off: list[float] = []
    on: list[float] = []
    for _ in range(ROUNDS):
        for keep, sink in ((False, off), (True, on)):
            metrics.keep_seconds(keep)
            started = time.perf_counter()
            for _ in range(n):
                metrics.admitted(["llm"])
            sink.append((time.perf_counter() - started) / n * 1e6)
            metrics.take_seconds()
    metrics.keep_seconds(False)
    metrics.reset()
    gate = Gate(redis.Redis.from_url(url), prefix="bench-decide")
    limit = Limit("llm", parse_rate("1000000/s"), 1000)
    calls = max(1000, n // 40)
    started = time.perf_counter()
    for _ in range(calls):
        gate.acquire_many([limit])
    decision = (time.perf_counter() - started) / calls * 1e6
    gate.close()
    return [("count an admission, history off", statistics.median(off)),
            ("count an admission, history on", statistics.median(on)),
            ("one gate decision (Redis on 127.0.0.1)", decision)]


def per_second(url: str) -> list[tuple[int, float, int]]:
    """(limits, median ms of one write of a second's counts, commands sent)."""
    client = redis.Redis.from_url(url)
    writer = CountsWriter(client, "bench-counts")
    rows = []
    for limits in (1, 10, 100):
        names = [f"limit-{i}" for i in range(limits)]
        times = []
        for _ in range(50):
            metrics.keep_seconds(True)
            metrics.admitted(names)
            metrics.deferred(names[0], 1.0)
            metrics.provider_paused(names[:1])
            started = time.perf_counter()
            writer.write()
            times.append((time.perf_counter() - started) * 1e3)
        fields = limits + 3  # admitted per limit; deferred, its wait, a pause for one
        rows.append((limits, statistics.median(times), fields + 1))
    metrics.keep_seconds(False)
    metrics.reset()
    client.close()
    return rows


def per_refresh(url: str, key_values: list[int]
                ) -> list[tuple[int, float, int, float, float, int]]:
    """(key values waiting, status ms, status bytes, first history ms, history ms, its
    bytes)."""
    rows = []
    for values in key_values:
        client = redis.Redis.from_url(url)
        client.flushall()
        app = Celery("bench", broker=url, set_as_current=False)
        app.conf.throttle_redis_url = url

        @throttled("5/s", name="tenants", key="tenant")
        @app.task(shared=False, name="bench.tenant")
        def tenant(tenant: str) -> None: ...

        queues = Lines(client, "throttle")
        rate = parse_rate("5/s")
        for i in range(values):
            limit = Limit("tenants", rate, key=f"tenant-{i}")
            queues.enqueue(f"e{i}", b"m", f"t{i}", limits=[limit], blocking=limit,
                           place_us=i)
        charts = Charts(app)
        started = time.perf_counter()
        charts.since(None)  # a page's first read: every second of the 900 from the store
        first_ms = (time.perf_counter() - started) * 1e3
        status_ms, history_ms = [], []
        doc: dict[str, object] = {}
        hist: dict[str, object] = {}
        for _ in range(10):
            started = time.perf_counter()
            doc = report.status(app)
            status_ms.append((time.perf_counter() - started) * 1e3)
            charts.sample()
            started = time.perf_counter()
            hist = charts.since(None)
            history_ms.append((time.perf_counter() - started) * 1e3)
        rows.append((values, statistics.median(status_ms), len(json.dumps(doc)), first_ms,
                     statistics.median(history_ms), len(json.dumps(hist))))
        forget(app)
        app.close()
        client.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the three tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=10_000)
    args = parser.parse_args(argv)
    with RedisServer() as server:
        decide = per_decision(server.url, args.decisions)
        write = per_second(server.url)
        refresh = per_refresh(server.url, [0, 1000, args.keys])
    print(f"`python -m benchmarks.dashboard --decisions {args.decisions} --keys {args.keys}`: "
          "no workers; medians of the rounds.\n")
    print("| on a decision's path | us per call |")
    print("|---|---:|")
    for what, us in decide:
        print(f"| {what} | {us:.2f} |")
    print("\n| a busy worker process, once a second: its counts of | ms per write "
          "| commands (one pipelined call) |")
    print("|---|---:|---:|")
    for limits, ms, commands in write:
        print(f"| {limits} limit(s) | {ms:.2f} | {commands} |")
    print("\n| one per-key limit, tasks waiting over | `/api/status` ms | bytes "
          "| `/api/history`: first read ms | then ms | bytes (900 s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for values, sms, sbytes, first, hms, hbytes in refresh:
        print(f"| {values:,} key values | {sms:.1f} | {sbytes:,} | {first:.1f} | {hms:.1f} "
              f"| {hbytes:,} |")


if __name__ == "__main__":
    main()
