"""Pool processes' memory while a backlog is deferred, with and without ``throttle_gc_freeze``.

    python -m benchmarks.pool_memory [--n 3000] [--rate 5] [--seconds 15]

One worker node x 4 prefork processes per run, on its own Redis; ``--n``
tasks of one limit published at once, so nearly all of them are deferred
(parked) while the node takes them in.  Read from outside the node: each pool
process's private memory (``Private_Dirty`` in ``/proc/PID/smaps_rollup``)
before the publish and ``--seconds`` after it, and the node's PSS growth.
The two runs (freeze on, the default; freeze off) are side by side.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

from celery_throttle.testing import RedisServer, workers

ROOT = Path(__file__).resolve().parent.parent


def _rollup(pid: str, field: str) -> float:
    """One field of a process's smaps_rollup, MB (0 if it ended)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return out.split()


def run(n: int, rate: int, seconds: float, freeze: bool) -> dict[str, float]:
    """One run on a fresh server; returns the measures."""
    with RedisServer() as server:
        os.environ["BENCH_REDIS"], os.environ["BENCH_RATE"] = server.url, str(rate)
        loaded = sys.modules.get("benchmarks.bench_app")
        bench = importlib.reload(loaded) if loaded else importlib.import_module(
            "benchmarks.bench_app")
        env = {"BENCH_REDIS": server.url, "BENCH_RATE": str(rate), "PYTHONPATH": str(ROOT),
               "BENCH_GC_FREEZE": "1" if freeze else "0"}
        with workers("benchmarks.bench_app", ("m1",), concurrency=4, queues=("celery",),
                     cwd=ROOT, env=env) as (node,):
            time.sleep(1.0)  # the pool processes' own start
            kids = _children(node.proc.pid)
            before = [_rollup(k, "Private_Dirty") for k in kids]
            node_before = sum(_rollup(p, "Pss") for p in [str(node.proc.pid), *kids])
            for i in range(n):
                bench.ours.delay(i)
            time.sleep(seconds)
            after = [_rollup(k, "Private_Dirty") for k in kids]
            node_after = sum(_rollup(p, "Pss") for p in [str(node.proc.pid), *kids])
            deferred = node.log_text().count("waits ")
        bench.app.close()
    growth = [a - b for a, b in zip(after, before, strict=True)]
    return {"before": sum(before) / len(before), "after": sum(after) / len(after),
            "worst": max(growth), "node": node_after - node_before, "deferred": deferred}


def main(argv: list[str] | None = None) -> None:
    """Run both and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rate", type=int, default=5, help="starts per second")
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args(argv)
    rows = {freeze: run(args.n, args.rate, args.seconds, freeze) for freeze in (True, False)}
    print(f"{args.n} tasks at {args.rate}/s published at once to 1 node x 4 prefork processes; "
          f"memory read {args.seconds:g} s after the publish (`python -m benchmarks.pool_memory "
          f"--n {args.n} --rate {args.rate} --seconds {args.seconds:g}`).\n")
    print("| `throttle_gc_freeze` | tasks deferred | private MB per pool process, before -> after "
          "(mean) | worst pool process growth | node PSS growth |")
    print("|---|---:|---:|---:|---:|")
    for freeze, r in rows.items():
        print(f"| {freeze} | {r['deferred']:.0f} | {r['before']:.0f} -> {r['after']:.0f} | "
              f"+{r['worst']:.0f} MB | +{r['node']:.0f} MB |")


if __name__ == "__main__":
    main()
