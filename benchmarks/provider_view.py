"""Section 1: what the provider sees, every contender side by side on the same workers.

Each contender gets the same backlog (10x its per-second limit) on the same
2 prefork nodes x 4 processes, one after the other; its task bodies record
their start times, which are judged against the limit.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from celery_throttle.testing import max_in_window, workers

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = (0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Outcome:
    """One contender's run, judged."""

    name: str
    sent: int
    starts: list[float]
    ids: list[str]
    deferrals: list[int]
    t0: float

    def worst(self, window: float) -> int:
        return max_in_window(self.starts, window)

    @staticmethod
    def bound(rate: int, window: float) -> int:
        return math.ceil(window * rate - 1e-9)  # burst 1: B - 1 + ceil(w * rate)

    def over(self, rate: int) -> int:
        return sum(self.worst(w) > self.bound(rate, w) for w in WINDOWS)

    def utilisation(self, rate: int) -> float:
        if len(self.starts) < 2:
            return 0.0
        return (len(self.starts) - 1) / (self.starts[-1] - self.starts[0]) / rate

    def lateness(self, rate: int) -> tuple[float, float]:
        """p50 and p99 of (start - earliest permitted start): the k-th vs first + k / rate."""
        late = [s - (self.starts[0] + k / rate) for k, s in enumerate(self.starts)]
        if not late:
            return math.nan, math.nan
        ordered = sorted(late)
        return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def smallest_gap(self) -> float:
        """The shortest time between two consecutive starts, seconds (burst 1: >= 1/rate)."""
        return min((b - a for a, b in zip(self.starts, self.starts[1:], strict=False)),
                   default=math.nan)

    @property
    def unfinished(self) -> int:
        return self.sent - len(set(self.ids))

    @property
    def doubled(self) -> int:
        return len(self.ids) - len(set(self.ids))


def run(url: str, rate: int, *, timeout_factor: float = 2.5) -> list[Outcome]:
    """Run every contender in turn, each on fresh workers; return their outcomes."""
    os.environ["BENCH_REDIS"], os.environ["BENCH_RATE"] = url, str(rate)
    bench = importlib.import_module("benchmarks.bench_app")
    records = redis.Redis.from_url(f"{url}/8")
    for db in (5, 6, 7, 8):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    n = 10 * rate
    timeout = n / rate * timeout_factor + 10
    outcomes = []
    env = {"BENCH_REDIS": url, "BENCH_RATE": str(rate), "PYTHONPATH": str(ROOT)}
    for name, task in bench.CONTENDERS.items():
        # Fresh workers and an empty broker for each contender: leftovers (a
        # slow contender's retries, Celery's rate-limit state) must not slow
        # the next one.
        redis.Redis.from_url(f"{url}/5").flushdb()
        with workers("benchmarks.bench_app", ("b1", "b2"), concurrency=4, queues=("celery",),
                     cwd=ROOT, env=env):
            key = f"starts:{name}"
            t0 = time.time()
            for i in range(n):
                task.delay(i)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and records.llen(key) < n:
                time.sleep(0.1)
            time.sleep(1.5)  # late duplicates, if any
            rows = sorted((json.loads(r) for r in records.lrange(key, 0, -1)),
                          key=lambda r: r["t"])
        outcomes.append(Outcome(
            name, n, [r["t"] for r in rows], [r["id"] for r in rows],
            [max(r["retries"], r["deferrals"]) for r in rows], t0))
        print(f"  {name}: {len(rows)} starts", file=sys.stderr, flush=True)
    bench.app.close()
    return outcomes


def table(outcomes: list[Outcome], rate: int) -> str:
    """The markdown table."""
    head = ("| contender | " + " | ".join(f"max in {w:g} s (bound {Outcome.bound(rate, w)})"
                                           for w in WINDOWS)
            + f" | windows over | smallest gap ms (interval {1000 / rate:g}) | utilisation | "
            "deferrals / task | lateness p50 s | lateness p99 s | not run in time | run twice |")
    lines = [head, "|---" + "|---:" * (len(WINDOWS) + 8) + "|"]
    for o in outcomes:
        p50, p99 = o.lateness(rate)
        per_task = sum(o.deferrals) / len(o.deferrals) if o.deferrals else math.nan
        lines.append(
            f"| {o.name} | " + " | ".join(str(o.worst(w)) for w in WINDOWS)
            + f" | {o.over(rate)} | {o.smallest_gap() * 1000:.1f} | {o.utilisation(rate):.2f} | "
            f"{per_task:.2f} | "
            f"{p50:.3f} | {p99:.3f} | {o.unfinished} | {o.doubled} |")
    return "\n".join(lines)


def headline(outcomes: list[Outcome], rate: int) -> str:
    """One line per contender: the worst excess over the bound, as a ratio and in starts."""
    lines = ["Headline (worst window of any length, starts over the bound):\n"]
    for o in outcomes:
        excess = max(o.worst(w) - o.bound(rate, w) for w in WINDOWS)
        ratio = max(o.worst(w) / o.bound(rate, w) for w in WINDOWS)
        per_task = sum(o.deferrals) / len(o.deferrals) if o.deferrals else math.nan
        lines.append(f"* {o.name}: {ratio:.2f}x the bound at worst ({excess:+d} starts), "
                     f"utilisation {o.utilisation(rate):.2f}, {per_task:.2f} broker "
                     "publishes per task")
    return "\n".join(lines)


def chart(outcomes: list[Outcome], rate: int, path: Path) -> None:
    """Cumulative starts over time per contender, against the limit's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    horizon = 0.0
    for o in outcomes:
        xs = [s - o.t0 for s in o.starts]
        horizon = max(horizon, *(xs or [0.0]))
        left.step(xs, range(1, len(xs) + 1), where="post", label=o.name,
                  linewidth=2.5 if o.name == "ours" else 1.2)
    left.plot([0, horizon], [1, 1 + horizon * rate], "k--", label=f"limit ({rate}/s)")
    left.set_xlabel("seconds since the backlog was sent")
    left.set_ylabel("starts (provider calls)")
    left.set_title("Cumulative starts")
    left.legend(fontsize=7)
    names = [o.name for o in outcomes]
    worst = [o.worst(1.0) for o in outcomes]
    colors = ["tab:green" if w <= Outcome.bound(rate, 1.0) else "tab:red" for w in worst]
    right.barh(names, worst, color=colors)
    right.axvline(Outcome.bound(rate, 1.0), color="k", linestyle="--", label="bound")
    right.set_xlabel("most starts in any 1 s window")
    right.set_title("Worst 1 s window (red: over the limit)")
    right.invert_yaxis()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
