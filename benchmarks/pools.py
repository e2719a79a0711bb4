"""Section 7: the pools.  One limited task on prefork, gevent and eventlet, and on prefork
with its processes recycled.

    python -m benchmarks.pools [--runs 10]

Green pools: one node (``-c 50`` for threads, gevent and eventlet, ``-c 8`` for prefork), 100 tasks
published at once at a limit of 20/s, each doing 0.2 s of I/O after its start: most of
them wait in line, and the node's dispatcher sends each on when its turn comes.

Recycling: two prefork nodes of 4 processes, 60 tasks at 10/s with no work, and
``worker_max_tasks_per_child`` unset, 10 and 3: a process is replaced after that many
runs, and a task that waits in line ends a run too.  With 10 and 3 also with
``throttle_pool_check_interval=0``: an exited process is replaced only when Celery's own
checks see it.  The control, Celery alone: 60 tasks with no limit published at 10/s to
the same nodes (with Celery's checks only), and how late each starts after its publish.

Recycling with seats (``--only seats``): the same two nodes, 60 tasks published at once to
``"10/s"`` with ``concurrency=4``, each working 0.2 s after its start, with
``worker_max_tasks_per_child`` unset and 3, taking turns; the ratio of the medians.

A new pool process's cost (``--only cost``): a parent that loaded the app as a worker's
main process does (its ``worker_init`` and its runtime) forks children one at a time, as
prefork does; each times ``worker_process_init`` (the throttle's receiver: a new store
client, the scripts loaded) and then its first three runs of the limited task (``"1000/s"``
with 4 seats: never waiting), called as a pool process calls it.  The first run's excess
over the third is what a process pays once, before its first start.

Every run starts fresh workers on emptied databases of one Redis server; the cases take
turns, run after run.  Used: starts per second from the first to the last, against the
limit.  Bound held: in every window of a quarter of a second to five seconds, at most
``ceil(window x rate) + 1`` starts (the suite's check).  Nothing here asserts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from celery_throttle.testing import max_in_window, redis_server, workers

ROOT = Path(__file__).resolve().parent.parent

#: (pool, concurrency) of the green-pool runs (threads beside them: also one process).
GREEN = (("prefork", 8), ("threads", 50), ("gevent", 50), ("eventlet", 50))
#: (worker_max_tasks_per_child, throttle_pool_check_interval) of the recycling runs
#: (None: never recycled; the default check).
RECYCLE: tuple[tuple[int | None, float | None], ...] = (
    (None, None), (10, None), (3, None), (10, 0.0), (3, 0.0))


@dataclass(frozen=True)
class Control:
    """What one run of Celery alone measured."""

    ran: int
    late_max: float  # the latest start after its publish, s
    late_over: int  # starts more than 0.5 s after their publish


@dataclass(frozen=True)
class Run:
    """What one run measured."""

    ran: int  # distinct tasks started
    twice: int  # starts beyond one per task
    used: float  # of the limit, first start to last
    bound: bool  # every window within the bound
    gap: float  # the longest time without a start, s
    in_line: float  # tasks that waited in line, per task
    processes: int  # pool processes that started a task


def _bound_held(times: Sequence[float], rate: float) -> bool:
    return all(max_in_window(times, w) <= math.ceil(w * rate - 1e-9) + 1
               for w in (0.25, 0.5, 1.0, 2.0, 5.0))


def run(url: str, *, pool: str, concurrency: int, nodes: int, n: int, rate: int, work: float,
        max_tasks_per_child: int | None = None, pool_check: float | None = None,
        seats: int | None = None) -> Run:
    """One run on fresh workers; the measures."""
    for db in (1, 2, 3, 4):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    env = {"POOLS_REDIS": url, "POOLS_RATE": str(rate), "POOLS_WORK": str(work),
           "PYTHONPATH": str(ROOT)}
    if max_tasks_per_child:
        env["POOLS_MAX_TASKS_PER_CHILD"] = str(max_tasks_per_child)
    if pool_check is not None:
        env["POOLS_POOL_CHECK"] = str(pool_check)
    if seats:
        env["POOLS_SEATS"] = str(seats)
    records = redis.Redis.from_url(f"{url}/4")
    from celery import Celery

    producer = Celery("pools", broker=f"{url}/1", set_as_current=False)
    names = tuple(f"p{k}" for k in range(1, nodes + 1))
    with workers("benchmarks.pools_app", names, pool=pool, concurrency=concurrency,
                 queues=("celery",), cwd=ROOT, env=env):
        for i in range(n):
            producer.send_task("benchmarks.pools_app.call", (i,))
        deadline = time.monotonic() + 30 + 3 * n / rate
        while time.monotonic() < deadline and records.llen("starts") < n:
            time.sleep(0.1)
        time.sleep(0.5)  # a second start of a task, if any, shows here
        rows = [json.loads(r) for r in records.lrange("starts", 0, -1)]
    producer.close()
    records.close()
    times = sorted(r["t"] for r in rows)
    ids = [r["id"] for r in rows]
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return Run(len(set(ids)), len(ids) - len(set(ids)),
               (len(times) - 1) / span / rate if span else 0.0, _bound_held(times, rate),
               max((b - a for a, b in itertools.pairwise(times)), default=0.0),
               sum(1 for r in rows if r["deferrals"]) / max(1, len(rows)),
               len({r["pid"] for r in rows}))


def control(url: str, *, max_tasks_per_child: int | None, n: int = 60, rate: int = 10
            ) -> Control:
    """Celery alone: ``n`` tasks with no limit published at ``rate`` per second."""
    for db in (1, 2, 3, 4):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    env = {"POOLS_REDIS": url, "PYTHONPATH": str(ROOT), "POOLS_POOL_CHECK": "0"}
    if max_tasks_per_child:
        env["POOLS_MAX_TASKS_PER_CHILD"] = str(max_tasks_per_child)
    records = redis.Redis.from_url(f"{url}/4")
    from celery import Celery

    producer = Celery("pools", broker=f"{url}/1", set_as_current=False)
    with workers("benchmarks.pools_app", ("p1", "p2"), concurrency=4, queues=("celery",),
                 cwd=ROOT, env=env):
        began = time.monotonic()
        for i in range(n):
            time.sleep(max(0.0, began + i / rate - time.monotonic()))
            producer.send_task("benchmarks.pools_app.free", (i, time.time()))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and records.llen("starts") < n:
            time.sleep(0.1)
        rows = [json.loads(r) for r in records.lrange("starts", 0, -1)]
    producer.close()
    records.close()
    late = [r["late"] for r in rows]
    return Control(len({r["id"] for r in rows}), max(late, default=0.0),
                   sum(1 for x in late if x > 0.5))


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def green_table(url: str, runs: int) -> str:
    """The green pools beside prefork and threads, ``runs`` runs each, taking turns."""
    got: dict[str, list[Run]] = {pool: [] for pool, _ in GREEN}
    for _ in range(runs):
        for pool, concurrency in GREEN:
            got[pool].append(run(url, pool=pool, concurrency=concurrency, nodes=1, n=100,
                                 rate=20, work=0.2))
    lines = ["| pool | runs | each ran once | bound held | used of 20/s (min / median / max) "
             "| runs at >= 0.95 | longest gap, s (max) | waited in line, per task |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for pool, concurrency in GREEN:
        rs = got[pool]
        lines.append(
            f"| `-P {pool} -c {concurrency}` | {len(rs)} "
            f"| {sum(r.ran == 100 and not r.twice for r in rs)} | {sum(r.bound for r in rs)} "
            f"| {_spread([r.used for r in rs])} | {sum(r.used >= 0.95 for r in rs)} "
            f"| {max(r.gap for r in rs):.3f} | {statistics.median(r.in_line for r in rs):.2f} |")
    return "\n".join(lines) + "\n"


def recycle_table(url: str, runs: int) -> str:
    """Prefork with and without recycling, ``runs`` runs each, taking turns."""
    got: dict[tuple[int | None, float | None], list[Run]] = {case: [] for case in RECYCLE}
    recycled = sorted({m for m, _ in RECYCLE}, key=lambda m: m or 0)
    alone: dict[int | None, list[Control]] = {m: [] for m in recycled}
    for _ in range(runs):
        for m, check in RECYCLE:
            got[(m, check)].append(run(url, pool="prefork", concurrency=4, nodes=2, n=60,
                                       rate=10, work=0.0, max_tasks_per_child=m,
                                       pool_check=check))
        for m in recycled:
            alone[m].append(control(url, max_tasks_per_child=m))
    plain = statistics.median(r.used for r in got[(None, None)])
    lines = ["| worker_max_tasks_per_child | exited processes replaced | runs | each ran once "
             "| bound held | used of 10/s (min / median / max) | median of unrecycled "
             "| runs at >= 0.9 of it | pool processes (median) | Celery alone: latest start "
             "after publish, s (median / max) | its starts > 0.5 s late |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for m, check in RECYCLE:
        rs, cs = got[(m, check)], alone[m]
        how = "-" if m is None else ("Celery's checks only" if check == 0
                                     else "also every 0.25 s (default)")
        lines.append(
            f"| {m or 'unset'} | {how} | {len(rs)} "
            f"| {sum(r.ran == 60 and not r.twice for r in rs)} "
            f"| {sum(r.bound for r in rs)} | {_spread([r.used for r in rs])} "
            f"| {statistics.median(r.used for r in rs) / plain:.3f} "
            f"| {sum(r.used >= 0.9 * plain for r in rs)} "
            f"| {statistics.median(r.processes for r in rs):.0f} "
            f"| {statistics.median(c.late_max for c in cs):.3f} / "
            f"{max(c.late_max for c in cs):.3f} | {sum(c.late_over for c in cs)} |")
    return "\n".join(lines) + "\n"


def seats_table(url: str, runs: int) -> str:
    """Prefork with seats, unrecycled and recycled every 3 runs, ``runs`` runs each, taking
    turns."""
    cases = (None, 3)
    got: dict[int | None, list[Run]] = {m: [] for m in cases}
    for _ in range(runs):
        for m in cases:
            got[m].append(run(url, pool="prefork", concurrency=4, nodes=2, n=60, rate=10,
                              work=0.2, max_tasks_per_child=m, seats=4))
    plain = statistics.median(r.used for r in got[None])
    lines = ["| worker_max_tasks_per_child | runs | each ran once | bound held "
             "| used of 10/s, each run | median | of unrecycled | pool processes (median) |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for m in cases:
        rs = got[m]
        median = statistics.median(r.used for r in rs)
        lines.append(
            f"| {m or 'unset'} | {len(rs)} | {sum(r.ran == 60 and not r.twice for r in rs)} "
            f"| {sum(r.bound for r in rs)} | {', '.join(f'{r.used:.3f}' for r in rs)} "
            f"| {median:.3f} | {median / plain:.3f} "
            f"| {statistics.median(r.processes for r in rs):.0f} |")
    return "\n".join(lines) + "\n"


def _child_costs(write: int) -> None:
    """In a forked child: time its init and its first runs, write them (ms, JSON), exit."""
    import os

    from celery import signals

    from benchmarks import pools_app

    times: dict[str, float] = {}
    began = time.perf_counter()
    signals.worker_process_init.send(sender=None)
    times["worker_process_init"] = time.perf_counter() - began
    for k in (1, 2, 3):
        task = pools_app.call
        task.push_request(id=f"cost-{os.getpid()}-{k}", called_directly=False, retries=0,
                          delivery_info={"exchange": "", "routing_key": "celery"}, headers={})
        began = time.perf_counter()
        try:
            task.run(k)
        finally:
            task.pop_request()
        times[f"run {k}"] = time.perf_counter() - began
    os.write(write, json.dumps({k: v * 1000 for k, v in times.items()}).encode())
    os._exit(0)


def process_cost(url: str, children: int) -> str:
    """What ``children`` new pool processes paid, one after another (ms, median / max)."""
    import os

    for db in (1, 2, 3, 4):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    os.environ.update({"POOLS_REDIS": url, "POOLS_RATE": "1000", "POOLS_SEATS": "4"})
    from celery import signals

    from benchmarks import pools_app
    from celery_throttle.integration.runtime import runtime_for

    signals.worker_init.send(sender=None)
    runtime = runtime_for(pools_app.app)
    runtime.gate.preload()  # (as the node's worker_ready does: the scripts, the store's
    runtime.durability.verdict()  # verdict)
    got: list[dict[str, float]] = []
    for _ in range(children):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read)
            _child_costs(write)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            raw = pipe.read()
        os.waitpid(pid, 0)
        got.append(json.loads(raw))
    lines = ["| step in a new pool process | ms (median / max) |", "|---|---|"]
    for step in got[0]:
        values = [g[step] for g in got]
        lines.append(f"| {step} | {statistics.median(values):.2f} / {max(values):.2f} |")
    first = [g["run 1"] - g["run 3"] for g in got]
    lines.append(f"| first run's excess over the third | {statistics.median(first):.2f} / "
                 f"{max(first):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each case")
    parser.add_argument("--only", choices=("green", "recycle", "seats", "cost"),
                        help="one table only")
    args = parser.parse_args(argv)
    with redis_server() as url:
        if args.only in (None, "green"):
            print(green_table(url, args.runs))
        if args.only in (None, "recycle"):
            print(recycle_table(url, args.runs))
        if args.only in (None, "seats"):
            print(seats_table(url, args.runs))
        if args.only in (None, "cost"):
            print(process_cost(url, max(args.runs, 10)))


if __name__ == "__main__":
    main()
