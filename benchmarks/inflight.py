"""Section 4: calls in flight.  A provider that takes 4 calls at once, 8 worker processes.

    python -m benchmarks.inflight [--n 48]

The mock provider (examples.provider) refuses a 5th call in flight with 429;
every call takes 0.5 s.  Contenders (benchmarks/bench_app.py), each on fresh
workers (2 nodes x 4 processes) against the same Redis:

* ``@throttled(concurrency=4)``: leases in the gate script; the waiters wait in the
  limit's line for a seat and the dispatcher gives it; without the waiting room
  waiters are paced by countdowns;
* a hand-written Redis counter (INCR/DECR) that retries after 0.1 s;
* no limit: call and retry after the provider's Retry-After.

Then the crash case: a node SIGKILLed while its calls are in flight, and how
long the booked starts stay lost (the counter's: for good).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import redis_server, workers
from examples.provider import MockProvider

ROOT = Path(__file__).resolve().parent.parent


def _fresh(url: str, provider: MockProvider, name: str, **env: str
           ) -> tuple[Any, Any, redis.Redis, dict[str, str]]:
    """Empty databases and provider log; the bench module, the task, the records, the env."""
    bench = importlib.import_module("benchmarks.bench_app")
    for db in (5, 6, 7, 8):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    provider.reset()
    return (bench, bench.INFLIGHT_CONTENDERS[name], redis.Redis.from_url(f"{url}/8"),
            {"BENCH_REDIS": url, "BENCH_PROVIDER": provider.url, "PYTHONPATH": str(ROOT),
             "BENCH_LEASE": "5", **env})


def _run(url: str, name: str, n: int, provider: MockProvider, **env_extra: str
         ) -> dict[str, float]:
    bench, task, records, env = _fresh(url, provider, name, **env_extra)
    with workers("benchmarks.bench_app", ("i1", "i2"), concurrency=4, queues=("celery",),
                 cwd=ROOT, env=env):
        t0 = time.time()
        for i in range(n):
            task.delay(i)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and records.llen(f"done:{name}") < n:
            time.sleep(0.05)
        span = time.time() - t0
    attempts = [json.loads(r) for r in records.lrange(f"calls:{name}", 0, -1)]
    done = records.lrange(f"done:{name}", 0, -1)
    busy = sum(end - start for start, end, _ in provider.calls)
    ideal = n * bench.CALL_SECONDS / bench.INFLIGHT
    publishes = sum(max(a["retries"], a["deferrals"]) for a in attempts
                    if a["id"].encode() in set(done)) / max(1, len(set(done)))
    return {"done": len(set(done)), "twice": len(done) - len(set(done)),
            "refused": len(provider.refused), "most": provider.most_inflight,
            "drain": span, "ideal": ideal, "occupancy": busy / (bench.INFLIGHT * span),
            "publishes": publishes}


def _crash(url: str, provider: MockProvider, name: str, **env_extra: str
           ) -> tuple[float | None, int]:
    """Kill the node holding 4 long calls; seconds until a new call starts (None: never)."""
    _, task, records, env = _fresh(url, provider, name, BENCH_CALL_SECONDS="3", **env_extra)
    with workers("benchmarks.bench_app", ("k1",), concurrency=4, queues=("q-kill",),
                 cwd=ROOT, env=env) as (doomed,), \
            workers("benchmarks.bench_app", ("k2",), concurrency=4, queues=("q-live",),
                    cwd=ROOT, env=env):
        for i in range(4):
            task.apply_async((i,), queue="q-kill")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and records.llen(f"calls:{name}") < 4:
            time.sleep(0.05)
        killed = time.time()
        doomed.kill()
        late = task.apply_async((99,), queue="q-live")
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and not late.ready():
            time.sleep(0.1)
        starts = [json.loads(r) for r in records.lrange(f"calls:{name}", 0, -1)]
    after = [s["t"] - killed for s in starts if s["t"] > killed]
    return (min(after) if after else None), len(provider.refused)


def main(argv: list[str] | None = None) -> None:
    """Print the section's markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=48)
    args = parser.parse_args(argv)
    provider = MockProvider(limit=1000, window=1.0, max_inflight=4).start()
    try:
        with redis_server() as url:
            os.environ["BENCH_REDIS"], os.environ["BENCH_PROVIDER"] = url, provider.url
            rows = {name: _run(url, name, args.n, provider)
                    for name in ("inflight_ours", "inflight_counter", "inflight_retry")}
            rows["countdown"] = _run(url, "inflight_ours", args.n, provider,
                                     BENCH_WAITING_ROOM="0")
            crash = {name: _crash(url, provider, name)
                     for name in ("inflight_ours", "inflight_counter")}
    finally:
        provider.stop()
    print(f"{args.n} calls of 0.5 s each; the provider takes 4 at once (ideal drain "
          f"{rows['inflight_ours']['ideal']:.1f} s); 2 nodes x 4 processes.\n")
    print("| contender | done / twice | 429s | most in flight | drain s | occupancy of the 4 "
          "slots | publishes / task |")
    print("|---|---|---:|---:|---:|---:|---:|")
    labels = {"inflight_ours": "`@throttled(concurrency=4)` (the seat's line)",
              "countdown": "`@throttled(concurrency=4)`, `throttle_waiting_room=False` (paced "
                           "countdowns)",
              "inflight_counter": "Redis INCR/DECR counter, retry 0.1 s",
              "inflight_retry": "no limit, retry after Retry-After"}
    for name, r in rows.items():
        print(f"| {labels[name]} | {r['done']:.0f} / {r['twice']:.0f} | {r['refused']:.0f} | "
              f"{r['most']:.0f} | {r['drain']:.1f} | {r['occupancy']:.2f} | "
              f"{r['publishes']:.2f} |")
    print("\nA node SIGKILLed while its 4 calls (3 s each) are in flight, lease 5 s; a new "
          "call is sent to the surviving node at once:\n")
    print("| contender | new call started after the kill | 429s |")
    print("|---|---:|---:|")
    for name, (after, refused) in crash.items():
        when = f"{after:.2f} s" if after is not None else "never (slots lost for good)"
        print(f"| {labels[name]} | {when} | {refused} |")


if __name__ == "__main__":
    main()
