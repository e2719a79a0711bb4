"""Redis CPU per task dispatched from the limits' queues: one key value against many.

    python -m benchmarks.keys_dispatch [--tasks 200000] [--values 100000] [--rate 5000]

No workers: the store alone, as the dispatchers drive it.  ``--tasks``
tasks are put in line (``Lines.enqueue``, as a worker puts them), then
served by ``Lines.serve_due`` in the dispatchers' batches until every one
is dispatched, sleeping between calls as a dispatcher does (until the next
queue is due); the trip estimate is set to 20 ms (a typical measured trip),
so each call serves what is due within it.  Four cases on fresh servers:

* a per-key limit (``key=``) at ``--rate``, every task of one key value;
* the same limit with the tasks spread over ``--values`` key values (each
  its own bucket and queue, each at ``--rate``);
* a shared limit at ``--rate`` with ``fair=``, every task of one value;
* the same with the tasks spread over ``--values`` fair key values, where
  the order is checked too: every value's n-th task is dispatched before
  any value's (n+1)-th (the turns of weighted fair queuing, equal weights).

Redis CPU is the server's own (``INFO cpu``, user + system) over the
dispatch, and the scripts' time (``INFO commandstats``, EVALSHA).  Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import redis

from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.room.dispatcher import BATCH
from celery_throttle.room.keys import room_key
from celery_throttle.room.lines import Lines
from celery_throttle.testing import RedisServer

PREFIX = "throttle"
TRIP_US = 20_000  # the trip estimate the dispatch serves ahead by
TIMEOUT_S = 600.0  # the most one case's dispatch may take
CLAIM_TIMEOUT_US = 3_600_000_000  # (nothing arrives here: no entry is due again)


@dataclass(frozen=True)
class Result:
    """One case: tasks dispatched, seconds, Redis CPU and script time per task (us)."""

    case: str
    dispatched: int
    seconds: float
    cpu_us: float
    script_us: float
    calls: int
    order: str


def _cpu(client: redis.Redis) -> tuple[float, float, int]:
    """The server's CPU seconds so far, its EVALSHA microseconds and calls."""
    cpu = client.info("cpu")
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            float(stats.get("usec", 0)), int(stats.get("calls", 0)))


def run(case: str, tasks: int, values: int, rate: str, fair: bool) -> Result:
    """Put ``tasks`` in line over ``values`` values, dispatch them all, measure."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        queues = Lines(client, PREFIX)
        parsed = parse_rate(rate)
        sec, usec = client.time()
        now = int(sec) * 1_000_000 + int(usec)
        nth: dict[str, int] = {}  # entry -> its rank among its value's tasks
        for i in range(tasks):
            value, n = f"v{i % values}", i // values
            limit = (Limit("shared", parsed, fair=value) if fair
                     else Limit("per-key", parsed, key=value))
            entry = f"{value}-{n}"
            nth[entry] = n
            queues.enqueue(entry, b"m", f"t{i}", limits=[limit], blocking=limit,
                           place_us=now + i)
        client.hset(room_key(PREFIX, "trip"), mapping={"avg": TRIP_US, "dev": 0})
        before = _cpu(client)
        start = time.monotonic()
        order: list[int] = []
        while len(order) < tasks and time.monotonic() - start < TIMEOUT_S:
            wait, served = queues.serve_due(BATCH, CLAIM_TIMEOUT_US)
            order += [nth[s.entry] for s in served]
            if wait is None:
                break
            if wait > 0:  # as a dispatcher does: the next due queue's time is slept
                time.sleep(min(wait, 0.25))
        seconds = time.monotonic() - start
        after = _cpu(client)
        client.close()
    done = max(len(order), 1)
    # Turns kept: the ranks come in order (all first tasks, then all second ones ...).
    late = sum(1 for a, b in itertools.pairwise(order) if b < a)
    return Result(case, len(order), seconds, (after[0] - before[0]) * 1e6 / done,
                  (after[1] - before[1]) / done, after[2] - before[2],
                  ("kept" if late == 0 else f"{late} out of turn") if fair and values > 1
                  else "-")


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200_000, help="tasks in line")
    parser.add_argument("--values", type=int, default=100_000, help="key values")
    parser.add_argument("--rate", default="5000/s", help="each limit's rate")
    args = parser.parse_args(argv)
    results = [
        run("per-key limit, 1 key value", args.tasks, 1, args.rate, fair=False),
        run(f"per-key limit, {args.values:,} key values", args.tasks, args.values, args.rate,
            fair=False),
        run("fair limit, 1 value", args.tasks, 1, args.rate, fair=True),
        run(f"fair limit, {args.values:,} values", args.tasks, args.values, args.rate,
            fair=True),
    ]
    print(f"{args.tasks:,} tasks in line, dispatched by `Lines.serve_due` in batches of "
          f"{BATCH} with a 20 ms trip estimate; each limit {args.rate} "
          f"(`python -m benchmarks.keys_dispatch --tasks {args.tasks} --values {args.values} "
          f"--rate {args.rate}`).\n")
    print("| case | dispatched | seconds | Redis CPU per task | script time per task "
          "| script calls per task | turns |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r.case} | {r.dispatched:,} | {r.seconds:.1f} | {r.cpu_us:.1f} us "
              f"| {r.script_us:.1f} us | {r.calls / max(r.dispatched, 1):.2f} | {r.order} |")
    one, many = results[0], results[1]
    print(f"\nper-key: {many.cpu_us / one.cpu_us:.2f}x the Redis CPU per task of one key "
          f"value; fair: {results[3].cpu_us / results[2].cpu_us:.2f}x")


if __name__ == "__main__":
    main()
