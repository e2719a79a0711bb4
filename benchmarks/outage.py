"""Section 8: a throttle store of its own without persistence, killed under a backlog.

    python -m benchmarks.outage [--n 300] [--runs 2]

The broker, results and records on one embedded Redis; the throttle's store on
another that keeps nothing on disk (a cache-like Redis).  Two worker nodes of 4
processes, ``bench-ours`` at 10/s, burst 1.  N tasks are published at once
with priority 6; 5 s later one urgent task with priority 0 (kombu's Redis
transport delivers 0 first); 8 s after the publish the store is SIGKILLed
for 4 s, then started again, empty.  Side by side in each run, on fresh
workers:

* ``countdown``: ``throttle_keep_beside_broker`` off: the store is not safe
  alone, so long waits are re-published with a countdown and stay in the
  broker;
* ``kept``: on: they wait in the store's line, each with a copy kept on the
  broker's server (``room/keeper.py``).

Measured: tasks run once, twice, never; the urgent task's wait (its start
after its publish); the limit used from the first start after the restart
to the last; broker publishes per task (re-publishes and dispatches, from
each start's header); the tasks waiting in the store at the kill.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import RedisServer, redis_server, workers

ROOT = Path(__file__).resolve().parent.parent
RATE = 10
URGENT_AFTER, KILL_AFTER, DOWN_FOR = 5.0, 8.0, 4.0


def _run(url: str, n: int, keep: bool) -> dict[str, Any]:
    bench = importlib.import_module("benchmarks.bench_app")
    for db in (5, 7, 8):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    records = redis.Redis.from_url(f"{url}/8")
    with RedisServer() as store:
        env = {"BENCH_REDIS": url, "BENCH_RATE": str(RATE), "BENCH_STORE": f"{store.url}/0",
               "BENCH_KEEP": "1" if keep else "0", "PYTHONPATH": str(ROOT)}
        with workers("benchmarks.bench_app", ("o1", "o2"), concurrency=4, queues=("celery",),
                     cwd=ROOT, env=env):
            t0 = time.time()
            ids = [bench.ours.apply_async((i,), priority=6).id for i in range(n)]
            time.sleep(max(0.0, t0 + URGENT_AFTER - time.time()))
            urgent_sent = time.time()
            urgent = bench.ours.apply_async((-1,), priority=0).id
            time.sleep(max(0.0, t0 + KILL_AFTER - time.time()))
            stored = redis.Redis.from_url(f"{store.url}/0")
            waiting = int(stored.hlen("{throttle}:room:messages"))
            stored.close()
            store.kill()
            time.sleep(DOWN_FOR)
            restarted = time.time()
            store.start()
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and len(
                    {json.loads(r)["id"] for r in records.lrange("starts:ours", 0, -1)}) < n + 1:
                time.sleep(0.2)
            time.sleep(2.0)  # a second run of a task would come within the dispatch timeout
    starts = [json.loads(r) for r in records.lrange("starts:ours", 0, -1)]
    runs = Counter(s["id"] for s in starts)
    after = sorted(s["t"] for s in starts if s["t"] >= restarted)
    used = ((len(after) - 1) / (after[-1] - after[0]) / RATE) if len(after) > 1 else 0.0
    urgent_start = min((s["t"] for s in starts if s["id"] == urgent), default=None)
    return {"once": sum(1 for i in [*ids, urgent] if runs[i] == 1),
            "twice": sum(1 for c in runs.values() if c > 1),
            "never": sum(1 for i in [*ids, urgent] if runs[i] == 0),
            "urgent": None if urgent_start is None else urgent_start - urgent_sent,
            "used": used, "waiting": waiting,
            "publishes": sum(s["deferrals"] for s in starts) / max(1, len(starts)),
            "drain": (max(s["t"] for s in starts) - t0) if starts else 0.0}


def main(argv: list[str] | None = None) -> None:
    """Print the section's markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    rows: list[tuple[str, dict[str, Any]]] = []
    with redis_server() as url:
        os.environ["BENCH_REDIS"] = url
        for _ in range(args.runs):
            for keep in (False, True):
                rows.append(("kept" if keep else "countdown", _run(url, args.n, keep)))
    print(f"{args.n} tasks at {RATE}/s (priority 6) published at once, one urgent task "
          f"(priority 0) {URGENT_AFTER:.0f} s later; the store killed {KILL_AFTER:.0f} s after "
          f"the publish for {DOWN_FOR:.0f} s; 2 nodes x 4 processes; {args.runs} runs, the two "
          "ways side by side in each.\n")
    print("| waits of the store that keeps nothing on disk | waiting in the store at the kill "
          "| ran once / twice / never | urgent task started after, s | used of the limit "
          "after the restart | publishes / task | last start, s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    labels = {"countdown": "re-published with a countdown (`throttle_keep_beside_broker` off)",
              "kept": "in the store's line, kept beside the broker (on)"}
    for name, r in rows:
        urgent = f"{r['urgent']:.2f}" if r["urgent"] is not None else "never"
        print(f"| {labels[name]} | {r['waiting']} | {r['once']} / {r['twice']} / {r['never']} "
              f"| {urgent} | {r['used']:.3f} | {r['publishes']:.2f} | {r['drain']:.1f} |")


if __name__ == "__main__":
    main()
