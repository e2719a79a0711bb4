"""Section 10: fair share and priority at any rate, beside an earlier version of the package.

    python -m benchmarks.fairness [--base REF] [--brokers redis,amqp] [--cases ...]

Three setups: a ``"20/s"`` and a ``"100/s"`` limit on two prefork nodes of 4
processes, and a ``"500/m"`` limit on two nodes of 16 threads
(``benchmarks/fair_app.py``).  Each case runs on fresh workers and emptied
databases, with this checkout and, given ``--base``, with the package as it
was there (``git archive``; the workers import it first), side by side.

* Fair share: tenants a, b and c (weights 3, 2, 1) each send the limit's
  15 s of work (at least 200 tasks) at once, in that order; 10 s later tenant
  d (weight 1) sends 10.  Shares: the starts of a, b and c among their first
  240 after c's first start, against 3:2:1 (the worst tenant's distance from
  its share, relative).  d: from its send to its 10th start, in intervals;
  by its weight, its 10 starts take 10 x 7 starts of the limit.  Used: starts
  per second from the first to the last, against the limit.  Window: the
  most starts in any 1 s (the bound: the rate plus the burst of 1).
* Priority: tasks at the batch priority, then, 2 s after their first start,
  when 200 of them are still to start, one at the urgent priority (Redis
  delivers 0 first, RabbitMQ 9): from its send to its start, in ms and in
  intervals, beside what the dispatch hands a task out ahead of its start
  (the lead and the measured trip: the way from the line to a worker).
* Steady: a limit that never builds a backlog: tasks sent at 0.8 x the rate,
  seeded random gaps, for 10 s: how late a start is after its send (median,
  95th percentile) and the publishes per task (one, plus one per wait outside
  the worker).
* Open: a limit the workers never reach (``"10000/s"``), 2,000 tasks sent at
  once: starts per second (what the worker's main process adds to each
  message: it asks the store whether the limit has a line) and publishes per
  task.

The store keeps waiting tasks on disk (``appendonly yes``), as a line needs
where the broker is RabbitMQ.  Nothing here asserts: the tables are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from celery_throttle.core.rates import parse_rate
from celery_throttle.room.keys import room_key
from celery_throttle.testing import max_in_window, redis_server, workers

ROOT = Path(__file__).resolve().parent.parent
APP = "benchmarks.fair_app"
WEIGHTS = {"a": 3, "b": 2, "c": 1, "d": 1}
FIRST = 240  # starts of a, b and c counted once all three are backlogged


@dataclass(frozen=True)
class Setup:
    """A limit and the nodes that run it."""

    rate: str
    pool: str
    concurrency: int

    @property
    def per_second(self) -> float:
        return 1.0 / parse_rate(self.rate).interval

    def __str__(self) -> str:
        return f"{self.rate}, 2 x {self.concurrency} {self.pool}"


SETUPS = (Setup("20/s", "prefork", 4), Setup("100/s", "prefork", 4),
          Setup("500/m", "threads", 16))


@dataclass(frozen=True)
class Env:
    """Where a case runs: the Redis server, the broker, and the package's version."""

    redis: str
    broker: str
    broker_kind: str
    path: str  # PYTHONPATH of the workers ("" for this checkout)


def _env(env: Env, setup: Setup) -> dict[str, str]:
    path = ":".join(p for p in (env.path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"FAIR_REDIS": env.redis, "FAIR_BROKER": env.broker, "FAIR_RATE": setup.rate,
            "PYTHONPATH": path}


@contextlib.contextmanager
def _nodes(env: Env, setup: Setup) -> Iterator[Any]:
    """Fresh databases and two fresh nodes; the producer's app bound to them."""
    for db in (1, 2, 4):
        redis.Redis.from_url(f"{env.redis}/{db}").flushdb()
    if env.broker_kind == "amqp":
        _purge_amqp(env)
    os.environ.update(_env(env, setup))
    sys.modules.pop(APP, None)
    import importlib
    app = importlib.import_module(APP)
    # (The working directory comes first on a worker's path: the version's own tree.)
    with workers(APP, ("f1", "f2"), pool=setup.pool, concurrency=setup.concurrency,
                 env=_env(env, setup), cwd=env.path or str(ROOT)):
        yield app
    app.app.close()


def _purge_amqp(env: Env) -> None:
    from kombu import Connection
    with Connection(env.broker) as conn:
        channel: Any = conn.channel()
        for queue in ("celery", "celery.dispatched"):
            with contextlib.suppress(Exception):
                channel.queue_purge(queue)


def _starts(env: Env) -> list[dict[str, Any]]:
    rows = [json.loads(r) for r in redis.Redis.from_url(f"{env.redis}/4").lrange("starts", 0, -1)]
    return sorted(rows, key=lambda r: r["t"])


def _until(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@dataclass(frozen=True)
class Fair:
    """What one fair-share run measured."""

    shares: dict[str, int]  # a, b, c among their first FIRST starts after c's first
    worst: float  # the largest relative distance of a share from its weight's
    d_intervals: float | None  # d's send to its 10th start, in intervals
    used: float
    window: int
    publishes: float


def fair_run(env: Env, setup: Setup) -> Fair:
    rate = setup.per_second
    each = max(200, math.ceil(15 * rate))
    with _nodes(env, setup) as fa:
        for tenant in "abc":
            sent = time.time()
            for _ in range(each):
                fa.shared.delay(tenant, sent)
        time.sleep(10)  # (the latecomer's moment, as a user sends it)
        d_sent = time.time()
        for _ in range(10):
            fa.shared.delay("d", d_sent)

        def enough() -> bool:
            rows = _starts(env)
            d = sum(1 for r in rows if r["tenant"] == "d")
            c = [i for i, r in enumerate(rows) if r["tenant"] == "c"]
            return d >= 10 and bool(c) and sum(1 for r in rows[c[0]:]
                                                if r["tenant"] != "d") >= FIRST
        _until(enough, 20 + 3 * each * 3 / rate)
        rows = _starts(env)
    c_first = next(i for i, r in enumerate(rows) if r["tenant"] == "c")
    counted = [r for r in rows[c_first:] if r["tenant"] != "d"][:FIRST]
    shares = Counter(r["tenant"] for r in counted)
    total = sum(WEIGHTS[t] for t in "abc")
    worst = max(abs(shares[t] - FIRST * WEIGHTS[t] / total) / (FIRST * WEIGHTS[t] / total)
                for t in "abc")
    d_starts = [r["t"] for r in rows if r["tenant"] == "d"]
    d_done = (max(d_starts) - d_sent) * rate if len(d_starts) >= 10 else None
    times = [r["t"] for r in rows]
    return Fair({t: shares[t] for t in "abc"}, worst, d_done,
                (len(times) - 1) / (times[-1] - times[0]) / rate,
                max_in_window(times, 1.0), 1 + statistics.fmean(r["waited"] for r in rows))


def _ahead_ms(env: Env) -> float:
    """What the dispatch hands a task out ahead of its start, as the run ends: the lead
    (0.05 s) plus the measured trip's average and two deviations (ms)."""
    store = redis.Redis.from_url(f"{env.redis}/2")
    est = store.hmget(room_key("throttle", "trip"), "avg", "dev")
    store.close()
    return 50 + (int(est[0] or 0) + 2 * int(est[1] or 0)) / 1000


def priority_run(env: Env, setup: Setup) -> tuple[float | None, float]:
    """The urgent task's send to its start, in intervals (None: not started in time), and
    the dispatch's ahead then (ms)."""
    rate = setup.per_second
    batch, urgent = (0, 9) if env.broker_kind == "amqp" else (9, 0)
    with _nodes(env, setup) as fa:
        sent = time.time()
        # (200 still to start when the urgent one is sent, 2 s after the first start)
        for _ in range(200 + math.ceil(2 * rate)):
            fa.ranked.apply_async(("batch", sent), priority=batch)
        _until(lambda: bool(_starts(env)), 30)
        first = _starts(env)[0]["t"] if _starts(env) else time.time()
        time.sleep(max(0.0, first + 2.0 - time.time()))
        u_sent = time.time()
        fa.ranked.apply_async(("urgent", u_sent), priority=urgent)
        _until(lambda: any(r["kind"] == "urgent" for r in _starts(env)), 200 / rate + 10)
        rows = _starts(env)
        ahead = _ahead_ms(env)
    started = [r["t"] for r in rows if r["kind"] == "urgent"]
    return ((started[0] - u_sent) * rate if started else None), ahead


@dataclass(frozen=True)
class Steady:
    """What one run of a limit that never builds a backlog measured."""

    late_median: float
    late_p95: float
    publishes: float
    starts_per_s: float


def steady_run(env: Env, setup: Setup, seed: int = 7) -> Steady:
    rate = setup.per_second
    gaps = random.Random(seed)
    with _nodes(env, setup) as fa:
        sent_n, began = 0, time.monotonic()
        while time.monotonic() - began < 10.0:
            fa.ranked.delay("steady", time.time())
            sent_n += 1
            time.sleep(gaps.expovariate(0.8 * rate))
        _until(lambda: len(_starts(env)) >= sent_n, 30)
        rows = _starts(env)
    late = sorted(r["t"] - r["sent"] for r in rows)
    times = [r["t"] for r in rows]
    return Steady(statistics.median(late), late[int(0.95 * (len(late) - 1))],
                  1 + statistics.fmean(r["waited"] for r in rows),
                  (len(times) - 1) / (times[-1] - times[0]))


def open_run(env: Env, setup: Setup, n: int = 2000) -> tuple[float, float]:
    """``n`` tasks sent at once to a limit the workers never reach: starts per second from
    the first to the last, and publishes per task."""
    with _nodes(env, setup) as fa:
        sent = time.time()
        for _ in range(n):
            fa.ranked.delay("open", sent)
        _until(lambda: len(_starts(env)) >= n, 120)
        rows = _starts(env)
    times = [r["t"] for r in rows]
    return ((len(times) - 1) / (times[-1] - times[0]),
            1 + statistics.fmean(r["waited"] for r in rows))


@contextlib.contextmanager
def _base_tree(ref: str) -> Iterator[str]:
    """The package as it was at ``ref``, in a temporary directory ("" for none)."""
    if not ref:
        yield ""
        return
    where = tempfile.mkdtemp(prefix="celery-throttle-base-")
    try:
        archive = subprocess.run(["git", "archive", ref, "celery_throttle"], cwd=ROOT,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def _brokers(kinds: Sequence[str], url: str) -> Iterator[dict[str, str]]:
    found = {"redis": f"{url}/1"}
    if "amqp" not in kinds:
        yield found
        return
    if not (Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists()
            or shutil.which("rabbitmq-server")):
        print("(rabbitmq-server is not installed: the RabbitMQ rows are left out)\n")
        yield found
        return
    sys.path.insert(0, str(ROOT))
    from tests.servers import RabbitMQ
    with RabbitMQ() as rabbit:
        yield {**found, "amqp": str(rabbit.url)}


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "not started" if value is None else format(value, spec)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="",
                        help="an earlier version (a git ref) to run beside this checkout")
    parser.add_argument("--brokers", default="redis,amqp")
    parser.add_argument("--cases", default="fair,priority,steady,open")
    parser.add_argument("--setups", default="20/s,100/s,500/m", help="the limits to run")
    args = parser.parse_args(argv)
    kinds = [k for k in args.brokers.split(",") if k]
    cases = args.cases.split(",")
    setups = [s for s in SETUPS if s.rate in args.setups.split(",")]
    with redis_server() as url, _base_tree(args.base) as base, _brokers(kinds, url) as brokers:
        # The store keeps waiting tasks on disk: with RabbitMQ as the broker, a store that
        # keeps nothing would send long waits to the broker with a countdown, not in line.
        redis.Redis.from_url(url).config_set("appendonly", "yes")
        versions = {f"`{args.base}`": base, "this": ""} if args.base else {"this": ""}
        if "fair" in cases:
            _fair_table(url, brokers, versions, setups)
        if "priority" in cases:
            _priority_table(url, brokers, versions, setups)
        if "steady" in cases:
            _steady_table(url, brokers, versions, setups)
        if "open" in cases:
            _open_table(url, brokers, versions)


def _fair_table(url: str, brokers: dict[str, str], versions: dict[str, str],
            setups: Sequence[Setup]) -> None:
    print("### Fair share (tenants a, b, c at weights 3:2:1, d 10 s later)\n")
    print("| limit | version | a / b / c of the first 240 | worst share off | "
          "d's 10 done (intervals; by weight: 70) | used | most in 1 s | publishes "
          "per task |")
    print("|---|---|---|---|---|---|---|---|")
    for setup in setups:
        for name, path in versions.items():
            f = fair_run(Env(url, brokers["redis"], "redis", path), setup)
            print(f"| {setup} | {name} | {f.shares['a']} / {f.shares['b']} / "
                  f"{f.shares['c']} | {f.worst:.0%} | {_fmt(f.d_intervals)} | "
                  f"{f.used:.2f} | {f.window} | {f.publishes:.2f} |", flush=True)


def _priority_table(url: str, brokers: dict[str, str], versions: dict[str, str],
                setups: Sequence[Setup]) -> None:
    print("\n### Priority (an urgent task sent behind 200 batch tasks)\n")
    print("| limit | broker | version | urgent: send to start, ms (intervals) | "
          "the dispatch's lead and trip, ms |")
    print("|---|---|---|---|---|")
    for setup in setups:
        for kind, broker in brokers.items():
            for name, path in versions.items():
                p, ahead = priority_run(Env(url, broker, kind, path), setup)
                shown = "not started" if p is None else \
                    f"{p / setup.per_second * 1000:.0f} ({p:.1f})"
                print(f"| {setup} | {kind} | {name} | {shown} | {ahead:.0f} |", flush=True)


def _steady_table(url: str, brokers: dict[str, str], versions: dict[str, str],
              setups: Sequence[Setup]) -> None:
    print("\n### A limit that never builds a backlog (sent at 0.8 x the rate)\n")
    print("| limit | version | late after send: median / p95 (ms) | publishes per task | "
          "starts/s |")
    print("|---|---|---|---|---|")
    for setup in setups:
        for name, path in versions.items():
            s = steady_run(Env(url, brokers["redis"], "redis", path), setup)
            print(f"| {setup} | {name} | {s.late_median * 1000:.0f} / "
                  f"{s.late_p95 * 1000:.0f} | {s.publishes:.2f} | "
                  f"{s.starts_per_s:.1f} |", flush=True)



OPEN = (Setup("10000/s", "prefork", 4), Setup("10000/s", "threads", 16))


def _open_table(url: str, brokers: dict[str, str], versions: dict[str, str]) -> None:
    print("\n### A limit the workers never reach (2,000 tasks at once)\n")
    print("| limit | version | starts/s | publishes per task |")
    print("|---|---|---|---|")
    for setup in OPEN:
        for name, path in versions.items():
            per_s, publishes = open_run(Env(url, brokers["redis"], "redis", path), setup)
            print(f"| {setup} | {name} | {per_s:.0f} | {publishes:.2f} |", flush=True)


if __name__ == "__main__":
    main()
