"""Section 3: a deep backlog behind one slow limit (its own Redis, its own workers).

    python -m benchmarks.scale [--n 50000] [--rate 5] [--measure 150] [--paths P,P]

All tasks are published at once (one producer thread, Celery priority 9: a
batch) to 2 prefork nodes x 4 processes with default settings (waiting tasks
wait in line), next to the same run on the countdown path
(``throttle_waiting_room=False``), and measured for ``--measure`` seconds
after the last publish (a backlog at a slow quota takes hours to drain: the
steady state is what counts). Ten seconds after the last publish one urgent
task of the same limit (priority 0: first on a Redis broker) is sent: how long
until it starts. Prints a markdown table: the rate of starts from 30 s after
the last publish on (against the limit), tasks run, run twice, throttle
publishes per task, messages held by the broker, worker RSS growth per node,
and Redis memory per waiting task (broker, store and results share the server;
the baseline before publishing is subtracted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from celery_throttle.testing import RedisServer, workers

ROOT = Path(__file__).resolve().parent.parent
# The steady state is measured from this long after the last publish on.
SETTLE = 30.0


def _rss_mb(pgid: int) -> float:
    """Memory of a worker node, MB: the PSS of every process in its process group.

    Not their RSS summed: prefork children share the parent's pages until
    they write to them (Python's reference counts do, soon), and RSS counts a
    shared page once per process.  Measured here: the summed RSS of a fresh
    node grew 440 MB in the first minutes whichever path deferred the tasks.
    """
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True,
                         text=True, check=False).stdout
    total_kb = 0
    for pid in out.split():
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kb += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            continue  # the process ended meanwhile
    return total_kb / 1024


def _held(broker: redis.Redis) -> int:
    """Messages the broker holds: queued in every priority list of the queue, and unacked.

    kombu's Redis transport keeps a priority other than 0 in a list of its own
    (``celery\x06\x169`` for 9: its separator, then the priority step).
    """
    lists = ["celery", *(f"celery\x06\x16{step}" for step in (3, 6, 9))]
    return sum(int(broker.llen(name)) for name in lists) + int(broker.hlen("unacked"))


def _waiting(store: redis.Redis) -> int:
    """Tasks waiting in the store: in line or in the room's timer (every stored message but
    those dispatched and on their way)."""
    return (int(store.hlen("{throttle}:room:messages"))
            - int(store.zcard("{throttle}:room:claimed")))


#: The paths compared: is the waiting room on?
PATHS = {"countdown": False, "scheduler": True}
#: Seconds after the last publish at which the urgent task is sent.
URGENT_AFTER = 10.0


def run(n: int, rate: int, measure: float, path: str) -> dict[str, float]:
    """One run on fresh servers; returns the measures."""
    with RedisServer() as server:
        url = server.url
        os.environ["BENCH_REDIS"], os.environ["BENCH_RATE"] = url, str(rate)
        # The app module reads the server's URL at import: a second run in this
        # process needs it imported again.
        loaded = sys.modules.get("benchmarks.bench_app")
        bench = importlib.reload(loaded) if loaded else importlib.import_module(
            "benchmarks.bench_app")
        client = redis.Redis.from_url(url)
        records = redis.Redis.from_url(f"{url}/8")
        broker = redis.Redis.from_url(f"{url}/5")
        store = redis.Redis.from_url(f"{url}/6")
        env = {"BENCH_REDIS": url, "BENCH_RATE": str(rate), "PYTHONPATH": str(ROOT)}
        env["BENCH_WAITING_ROOM"] = "1" if PATHS[path] else "0"
        with workers("benchmarks.bench_app", ("s1", "s2"), concurrency=4, queues=("celery",),
                     cwd=ROOT, env=env) as nodes:
            base_mem = int(client.info("memory")["used_memory"])
            base_rss = [_rss_mb(node.proc.pid) for node in nodes]
            peak_rss = list(base_rss)
            peak_parked, mem_at_peak = 0, base_mem
            started = time.time()
            for i in range(n):
                bench.ours.apply_async((i,), priority=9)
            published = time.time()
            urgent_sent = 0.0
            deadline = time.monotonic() + measure
            while time.monotonic() < deadline and records.llen("starts:ours") < n + 1:
                if not urgent_sent and time.time() >= published + URGENT_AFTER:
                    bench.ours.apply_async((-1,), priority=0)
                    urgent_sent = time.time()
                parked = _waiting(store)
                held = _held(broker)
                if parked + held >= peak_parked:
                    peak_parked = parked + held
                    mem_at_peak = int(client.info("memory")["used_memory"])
                peak_rss = [max(p, _rss_mb(node.proc.pid)) for p, node in zip(
                    peak_rss, nodes, strict=True)]
                time.sleep(1.0)
            held = _held(broker)
            parked = _waiting(store)
        rows = [json.loads(r) for r in records.lrange("starts:ours", 0, -1)]
        bench.app.close()
        for c in (client, records, broker, store):
            c.close()
    urgent = [r["t"] for r in rows if r.get("i") == -1]
    rows = [r for r in rows if r.get("i") != -1]
    starts = sorted(r["t"] for r in rows)
    steady = [t for t in starts if t >= published + SETTLE]
    steady_rate = ((len(steady) - 1) / (steady[-1] - steady[0])) if len(steady) > 1 else 0.0
    ids = [r["id"] for r in rows]
    return {
        "published_s": published - started, "ran": len(set(ids)),
        "twice": len(ids) - len(set(ids)), "steady": steady_rate / rate,
        "steady_rate": steady_rate,
        "publishes": sum(r["deferrals"] for r in rows) / max(1, len(rows)),
        "held": held, "parked": parked,
        "rss": max(p - b for p, b in zip(peak_rss, base_rss, strict=True)),
        "bytes_per_waiting": (mem_at_peak - base_mem) / max(1, peak_parked),
        "peak_waiting": peak_parked,
        "urgent": urgent[0] - urgent_sent if urgent and urgent_sent else -1.0,
        "urgent_window": time.time() - urgent_sent if urgent_sent else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    """Run and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50000)
    parser.add_argument("--rate", type=int, default=5, help="starts per second")
    parser.add_argument("--measure", type=float, default=150.0,
                        help="seconds measured after the last publish")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"the paths to compare, side by side (of {', '.join(PATHS)})")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        parser.error(f"unknown path {unknown[0]!r}; known: {', '.join(PATHS)}")
    results = {path: run(args.n, args.rate, args.measure, path) for path in paths}
    print(f"{args.n} tasks of one limit at {args.rate}/s ({args.rate * 60}/m), published at "
          f"once; 2 prefork nodes x 4 processes, default settings, one Redis for broker, "
          f"store and results; measured {args.measure:.0f} s after the last publish "
          f"(`python -m benchmarks.scale --n {args.n} --rate {args.rate} --measure "
          f"{args.measure:g}`).  The tasks are sent with priority 9, the urgent one with 0.\n")
    names = {"countdown": "countdown (`throttle_waiting_room=False`)",
             "scheduler": "in line (default)"}
    print("| measure | " + " | ".join(names[p] for p in paths) + " |")
    print("|---|" + "---:|" * len(paths))
    lines: list[tuple[str, Callable[[dict[str, float]], str]]] = [
        ("publishing all tasks", lambda r: f"{r['published_s']:.1f} s"),
        (f"starts/s from {SETTLE:.0f} s after the last publish (share of the limit)",
         lambda r: f"{r['steady_rate']:.2f} ({r['steady']:.2f})"),
        ("tasks run", lambda r: f"{r['ran']:.0f}"),
        ("run twice", lambda r: f"{r['twice']:.0f}"),
        ("throttle publishes per task run", lambda r: f"{r['publishes']:.2f}"),
        ("messages in the broker at the end (queued + unacked)", lambda r: f"{r['held']:.0f}"),
        ("tasks parked or in line in Redis at the end", lambda r: f"{r['parked']:.0f}"),
        (f"an urgent task (priority 0) sent {URGENT_AFTER:.0f} s after the last publish: "
         "started after", lambda r: f"{r['urgent']:.2f} s" if r["urgent"] >= 0 else
         f"not within {r['urgent_window']:.0f} s"),
        ("worker node memory growth (PSS of all its processes), worst node",
         lambda r: f"{r['rss']:.0f} MB"),
        ("Redis memory per waiting task (at the peak count)",
         lambda r: f"{r['bytes_per_waiting']:.0f} B ({r['peak_waiting']:.0f} waiting)"),
        ("projected for 1,000,000 waiting tasks",
         lambda r: f"{r['bytes_per_waiting'] * 1e6 / 2**30:.2f} GiB"),
    ]
    for label, fmt in lines:
        print(f"| {label} | " + " | ".join(fmt(results[p]) for p in paths) + " |")


if __name__ == "__main__":
    main()
