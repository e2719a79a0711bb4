"""Section 2, continued: client threads, and Redis CPU and memory against `limits` and pyrate.

Ours keeps one integer per bucket whatever the limit; a moving window
(`limits`) keeps one list entry per request in the window and pyrate-limiter's
Redis bucket one sorted-set member per request, so their memory and, for
`limits`, their per-decision CPU grow with the limit.  Each is measured at a
full window (the state a busy limit lives in).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from celery_throttle import Gate, Limit, parse_rate


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def threads_table(url: str, total: int = 6000) -> str:
    """p50/p99 latency and throughput of PING and a gate decision with 1, 8, 32 threads."""
    pool = redis.ConnectionPool.from_url(url, max_connections=64)
    client = redis.Redis(connection_pool=pool)
    gate = Gate(client, prefix=f"bench-{uuid.uuid4().hex[:8]}")
    gate.preload()
    fast = [Limit("fast", parse_rate("1000000/s"), burst=100000)]
    ops: dict[str, Callable[[], object]] = {
        "PING": client.ping, "gate decision": lambda: gate.acquire_many(fast)}
    lines = ["| threads | operation | p50 us | p99 us | per second (all threads) |",
             "|---:|---|---:|---:|---:|"]
    for threads in (1, 8, 32):
        for name, fn in ops.items():
            per_thread = total // threads
            samples: list[list[float]] = [[] for _ in range(threads)]

            def work(out: list[float], fn: Callable[[], object] = fn,
                     n: int = per_thread) -> None:
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)

            workers = [threading.Thread(target=work, args=(samples[i],)) for i in range(threads)]
            started = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join(120)
            elapsed = time.perf_counter() - started
            flat = [x for s in samples for x in s]
            lines.append(f"| {threads} | {name} | {statistics.median(flat) * 1e6:.0f} | "
                         f"{_pct(flat, 0.99) * 1e6:.0f} | {len(flat) / elapsed:,.0f} |")
    client.close()
    return "\n".join(lines)


def _cpu_per_call(client: redis.Redis, fn: Callable[[], object], n: int = 300) -> float:
    """Redis CPU (all commands, INFO commandstats) per call of ``fn``, microseconds."""
    client.config_resetstat()
    for _ in range(n):
        fn()
    stats = client.info("commandstats")
    usec = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_config")
    return float(usec) / n


def _memory(client: redis.Redis, pattern: str) -> int:
    # A benchmark may scan; the library never does.
    return sum(int(client.memory_usage(k, samples=0) or 0)
               for k in client.scan_iter(match=pattern))


def compare_table(url: str) -> str:
    """Redis CPU per decision and memory per limit at a full window, three libraries."""
    from limits import (
        RateLimitItemPerDay,
        RateLimitItemPerMinute,
        RateLimitItemPerSecond,
        strategies,
    )
    from limits import storage as limits_storage
    from pyrate_limiter import Duration, Limiter, RedisBucket
    from pyrate_limiter import Rate as PyrateRate

    client = redis.Redis.from_url(url)
    lines = ["| limit | library | Redis CPU per decision, us | memory at a full window, bytes |",
             "|---|---|---:|---:|"]
    specs: list[tuple[str, int, Any, Any]] = [
        ("10/s", 10, RateLimitItemPerSecond(10), Duration.SECOND),
        ("1000/m", 1000, RateLimitItemPerMinute(1000), Duration.MINUTE),
        ("100000/d", 100000, RateLimitItemPerDay(100000), Duration.DAY),
    ]
    for text, count, item, duration in specs:
        tag = uuid.uuid4().hex[:8]
        # ours: fill the burst-1 bucket (one start), then decide (denied) repeatedly
        gate = Gate(client, prefix=f"ours-{tag}")
        lim = Limit("l", parse_rate(text))
        gate.acquire_many([lim])
        cpu = _cpu_per_call(client, functools.partial(gate.acquire_many, [lim]))
        lines.append(f"| {text} | celery_throttle (GCRA) | {cpu:.1f} | "
                     f"{_memory(client, f'{{ours-{tag}}}:l')} |")
        # limits: moving window filled to the limit in one call, then denied hits
        mw = strategies.MovingWindowRateLimiter(limits_storage.RedisStorage(url))
        mw.hit(item, f"lim-{tag}", cost=count)
        cpu = _cpu_per_call(client, functools.partial(mw.hit, item, f"lim-{tag}"))
        lines.append(f"| {text} | limits (moving window) | {cpu:.1f} | "
                     f"{_memory(client, f'*lim-{tag}*')} |")
        # pyrate-limiter: Redis bucket filled to the limit, then denied acquires
        bucket = RedisBucket.init([PyrateRate(count, duration)], client, f"pyr-{tag}")
        limiter = Limiter(bucket)
        limiter.try_acquire("x", weight=count, blocking=False)
        cpu = _cpu_per_call(client, functools.partial(limiter.try_acquire, "x",
                                                      blocking=False))
        lines.append(f"| {text} | pyrate-limiter (Redis bucket) | {cpu:.1f} | "
                     f"{_memory(client, f'*pyr-{tag}*')} |")
    client.close()
    return "\n".join(lines)
