"""Section 2, continued: waiting outside Celery, next to what an AI team would pick instead.

    python -m benchmarks.waiters

N threads, then N coroutines, wait on one limit of RATE per second (burst 1),
each taking K starts; waiter i arrives 2 ms after waiter i-1.  Contenders:
celery_throttle (``Gate.wait`` / ``AsyncGate.wait``), steindamm's Redis token
bucket (sync and async context managers) and llmratelimiter (async only; it
needs Python >= 3.12, so it runs in its own interpreter, ``waiters_llmrl.py``,
in a venv this benchmark makes, or is reported as not run).  Measured per
run: the achieved rate against the limit, the most starts in any 1 s window
against the bound (RATE), script calls and their Redis CPU per start (INFO
commandstats; every contender works in Lua scripts), and FIFO: the share of
waiter pairs whose first starts came in their arrival order (1.00 = first
come, first served).  Calls spaced tens of milliseconds apart find the
server's caches cold: a script costs several times what it does in a tight
loop (section 2's figures), alike for every contender.

Each waiter asks again right after its start, so its next slot is N
intervals ahead: with N = 4 (200 ms) it is within the gate's ``NEAR`` and
admitted in the call that books it; further ahead it is booked, then
claimed (two calls).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from celery_throttle import AsyncGate, Gate, Limit, parse_rate
from celery_throttle.testing import max_in_window, redis_server

ROOT = Path(__file__).resolve().parent.parent
RATE, K = 20, 5


@dataclass
class Run:
    """One contender's starts (epoch seconds) and each waiter's arrival and first start."""

    starts: list[float]
    arrivals: list[float]
    firsts: list[float]


def _threads(n: int, make: Callable[[str], Callable[[], None]], url: str) -> Run:
    arrivals, firsts, starts = [0.0] * n, [0.0] * n, []
    lock = threading.Lock()
    acquire = make(url)

    def waiter(i: int) -> None:
        time.sleep(i * 0.002)
        arrivals[i] = time.time()
        for j in range(K):
            acquire()
            now = time.time()
            with lock:
                starts.append(now)
            if j == 0:
                firsts[i] = now

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return Run(starts, arrivals, firsts)


def _coroutines(n: int, make: Callable[[str], tuple[Callable[[], Awaitable[Any]],
                                                    Callable[[], Awaitable[Any]]]],
                url: str) -> Run:
    async def main() -> Run:
        acquire, close = make(url)
        arrivals, firsts, starts = [0.0] * n, [0.0] * n, []

        async def waiter(i: int) -> None:
            await asyncio.sleep(i * 0.002)
            arrivals[i] = time.time()
            for j in range(K):
                await acquire()
                now = time.time()
                starts.append(now)
                if j == 0:
                    firsts[i] = now

        await asyncio.gather(*(waiter(i) for i in range(n)))
        await close()
        return Run(starts, arrivals, firsts)

    return asyncio.run(main())


def _ours_sync(url: str) -> Callable[[], None]:
    gate = Gate(redis.Redis.from_url(url, max_connections=64), prefix=_prefix())
    limits = [Limit("waiters", parse_rate(f"{RATE}/s"))]

    def acquire() -> None:
        gate.wait(limits, timeout=120)

    return acquire


def _ours_async(url: str) -> tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]:
    gate = AsyncGate(aioredis.Redis.from_url(url), prefix=_prefix())
    limits = [Limit("waiters", parse_rate(f"{RATE}/s"))]
    return (lambda: gate.wait(limits, timeout=120)), gate.aclose


def _steindamm_sync(url: str) -> Callable[[], None]:
    from steindamm import SyncRedisTokenBucket

    bucket = SyncRedisTokenBucket(connection=redis.Redis.from_url(url, max_connections=64),
                                  name=_prefix(), capacity=1, refill_frequency=1 / RATE,
                                  refill_amount=1, max_sleep=0)

    def acquire() -> None:
        with bucket:
            pass

    return acquire


def _steindamm_async(url: str) -> tuple[Callable[[], Awaitable[Any]],
                                        Callable[[], Awaitable[Any]]]:
    from steindamm import AsyncRedisTokenBucket

    client = aioredis.Redis.from_url(url)
    bucket = AsyncRedisTokenBucket(connection=client, name=_prefix(), capacity=1,
                                   refill_frequency=1 / RATE, refill_amount=1, max_sleep=0)

    async def acquire() -> None:
        async with bucket:
            pass

    return acquire, client.aclose


def _llmratelimiter(url: str, n: int) -> Run | str:
    """Run llmratelimiter's waiters in a Python >= 3.12 venv; or say why not."""
    python = _python_312()
    if python is None:
        return "not run: llmratelimiter needs Python >= 3.12, none found"
    venv = ROOT / ".venv-bench-llmrl"
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                        "llmratelimiter==0.3.2"], check=True, timeout=600)
    done = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "benchmarks" /
                                                         "waiters_llmrl.py"),
                           url, str(n), str(K), str(RATE)], capture_output=True, text=True,
                          timeout=300, check=True)
    return Run(**json.loads(done.stdout.strip().splitlines()[-1]))


def _python_312() -> str | None:
    """An interpreter of Python >= 3.12 that really runs (pyenv shims may not)."""
    found = [shutil.which(name) for name in ("python3.13", "python3.12")]
    found += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[2-9]*/bin/python3"))]
    for python in filter(None, found):
        check = subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"],
                               capture_output=True, timeout=30, check=False)
        if check.returncode == 0:
            return python
    return None


def _prefix() -> str:
    return f"waiters-{uuid.uuid4().hex[:8]}"


def _measured(client: redis.Redis, run: Callable[[], Run | str]) -> tuple[Run | str, int, int]:
    client.config_resetstat()
    result = run()
    stats = client.info("commandstats")
    # A script's usec includes the commands it runs (which commandstats also
    # counts on their own): script calls and their time are the cost here.
    scripts = [v for k, v in stats.items() if k in ("cmdstat_eval", "cmdstat_evalsha")]
    return (result, sum(int(v["calls"]) for v in scripts), sum(int(v["usec"]) for v in scripts))


def _fifo(run: Run) -> float:
    by_arrival = [run.firsts[i] for i in sorted(range(len(run.firsts)),
                                                key=lambda i: run.arrivals[i])]
    pairs = list(itertools.combinations(by_arrival, 2))
    return sum(1 for a, b in pairs if a <= b) / len(pairs)


def _row(name: str, kind: str, n: int, result: Run | str, calls: int, usec: int) -> str:
    if isinstance(result, str):
        return f"| {name} | {kind} | {n} | {result} | | | | |"
    starts = sorted(result.starts)
    rate = (len(starts) - 1) / (starts[-1] - starts[0])
    return (f"| {name} | {kind} | {n} | {rate / RATE:.2f} | {max_in_window(starts, 1.0)} | "
            f"{calls / len(starts):.1f} | {usec / len(starts):.0f} | {_fifo(result):.2f} |")


def table(url: str, sizes: tuple[int, ...] = (4, 8, 32)) -> str:
    """The comparison table (one run per contender, kind and size, one after the other)."""
    client = redis.Redis.from_url(url)
    lines = [f"Limit {RATE}/s burst 1; each waiter takes {K} starts; bound: {RATE} starts in "
             "any 1 s window.\n",
             "| contender | waiters | N | achieved / limit | worst 1 s window | script calls "
             "per start | Redis script CPU us per start | FIFO |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        runs: list[tuple[str, str, Callable[[], Run | str]]] = [
            ("celery_throttle", "threads", functools.partial(_threads, n, _ours_sync, url)),
            ("steindamm", "threads", functools.partial(_threads, n, _steindamm_sync, url)),
            ("celery_throttle", "coroutines",
             functools.partial(_coroutines, n, _ours_async, url)),
            ("steindamm", "coroutines", functools.partial(_coroutines, n, _steindamm_async, url)),
            ("llmratelimiter", "coroutines", functools.partial(_llmratelimiter, url, n)),
        ]
        for name, kind, run in runs:
            print(f"  waiters: {name} {kind} x{n}", file=sys.stderr, flush=True)
            lines.append(_row(name, kind, n, *_measured(client, run)))
    client.close()
    return "\n".join(lines)


def main() -> None:
    """Print the table against a fresh server."""
    with redis_server() as url:
        print(table(url))


if __name__ == "__main__":
    main()
