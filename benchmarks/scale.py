"""Section 3: 20,000 tasks deferred at once by one limit (its own Redis, its own workers).

    python -m benchmarks.scale [--n 20000] [--rate 200]

Prints a markdown table: publish time, time to drain against the ideal,
deferrals per task, peak worker RSS per node and peak Redis memory (broker
and store share the server; the baseline before publishing is subtracted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import time
from pathlib import Path

import redis

from celery_throttle.testing import RedisServer, workers

ROOT = Path(__file__).resolve().parent.parent


def _rss_mb(pgid: int) -> float:
    """Resident memory of every process in a worker node's process group, MB."""
    out = subprocess.run(["ps", "-o", "rss=", "-g", str(pgid)], capture_output=True,
                         text=True, check=False).stdout
    return sum(int(x) for x in out.split()) / 1024


def main(argv: list[str] | None = None) -> None:
    """Run and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--max-sleep", type=float, default=0.0,
                        help="throttle_max_sleep (0: every wait is re-published)")
    args = parser.parse_args(argv)
    n, rate = args.n, args.rate
    with RedisServer() as server:
        url = server.url
        os.environ["BENCH_REDIS"], os.environ["BENCH_RATE"] = url, str(rate)
        bench = importlib.import_module("benchmarks.bench_app")
        client = redis.Redis.from_url(url)
        records = redis.Redis.from_url(f"{url}/8")
        env = {"BENCH_REDIS": url, "BENCH_RATE": str(rate), "PYTHONPATH": str(ROOT),
               "BENCH_MAX_SLEEP": str(args.max_sleep)}
        with workers("benchmarks.bench_app", ("s1", "s2"), concurrency=4, queues=("celery",),
                     cwd=ROOT, env=env) as nodes:
            base_mem = int(client.info("memory")["used_memory"])
            base_rss = [_rss_mb(node.proc.pid) for node in nodes]
            peak_mem, peak_rss = base_mem, list(base_rss)
            started = time.time()
            last_sample = 0.0
            for i in range(n):
                bench.ours.delay(i)
                if time.monotonic() - last_sample > 1.0:
                    last_sample = time.monotonic()
                    peak_mem = max(peak_mem, int(client.info("memory")["used_memory"]))
            published = time.time() - started
            deadline = time.monotonic() + n / rate * 2 + 60
            while time.monotonic() < deadline and records.llen("starts:ours") < n:
                peak_mem = max(peak_mem, int(client.info("memory")["used_memory"]))
                peak_rss = [max(p, _rss_mb(node.proc.pid)) for p, node in zip(
                    peak_rss, nodes, strict=True)]
                time.sleep(1.0)
            time.sleep(2.0)
            broker = redis.Redis.from_url(f"{url}/5")
            held = int(broker.llen("celery")) + int(broker.hlen("unacked"))
        rows = sorted((json.loads(r) for r in records.lrange("starts:ours", 0, -1)),
                      key=lambda r: r["t"])
        bench.app.close()
        client.close()
    starts = [r["t"] for r in rows]
    ids = [r["id"] for r in rows]
    ran = len(set(ids))
    drain = starts[-1] - started if starts else float("nan")
    ideal = (n - 1) / rate
    deferrals = sum(r["deferrals"] for r in rows) / max(1, len(rows))
    print(f"{n} tasks of one limit at {rate}/s, 2 prefork nodes x 4 processes, one Redis "
          f"for broker, store and results, `throttle_max_sleep={args.max_sleep:g}` "
          f"(`python -m benchmarks.scale --n {n} --rate {rate} --max-sleep "
          f"{args.max_sleep:g}`).\n")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| publishing {n} tasks (one producer thread) | {published:.1f} s |")
    print(f"| first publish to last start | {drain:.1f} s |")
    print(f"| ideal ({n - 1} intervals at {rate}/s) | {ideal:.1f} s |")
    print(f"| drain / ideal | {drain / ideal:.2f}"
          + (" (measuring stopped first)" if ran < n else "") + " |")
    span = starts[-1] - starts[0] if len(starts) > 1 else float("nan")
    print(f"| tasks run when measuring stopped ({n / rate * 2 + 60:.0f} s after publishing) "
          f"| {ran} |")
    print(f"| still waiting: messages in the broker (queued + unacknowledged) | {held} "
          f"(for {n - ran} tasks) |")
    print(f"| run twice | {len(ids) - len(set(ids))} |")
    print(f"| achieved rate between first and last start | {(len(starts) - 1) / span:.1f}/s "
          f"({(len(starts) - 1) / span / rate:.2f} of the limit) |")
    print(f"| deferrals per task | {deferrals:.2f} |")
    for node, base, peak in zip(("s1", "s2"), base_rss, peak_rss, strict=True):
        print(f"| worker node {node} RSS (all processes), idle -> peak | "
              f"{base:.0f} -> {peak:.0f} MB |")
    print(f"| Redis used_memory, idle -> peak | {base_mem / 2**20:.1f} -> "
          f"{peak_mem / 2**20:.1f} MB |")


if __name__ == "__main__":
    main()
