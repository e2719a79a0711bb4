"""Section "SDK retries": the OpenAI SDK's own retries against a quota, three wirings.

    python -m benchmarks.sdk_retries [--n 120] [--runs 5]

Each run: ``--n`` tasks on fresh workers (2 prefork nodes x 4 processes),
each one chat completion through the real ``openai`` SDK with its default
retries (2) to the mock provider (examples.provider: 10 requests in any
1 s, 429 with the provider's headers).  Once a quarter of the calls are done, the
provider refuses everything for 0.5 s (its own trouble, as a provider under
load does): every call in that moment is refused and retried by the SDK.  Contenders
(benchmarks/bench_app.py), each at 9/s:

* ``@throttled`` + ``gated_client`` (every request, retries included, gated);
  the same through the ``anthropic`` SDK (``messages.create``);
* ``@throttled`` around a plain client (the documented wiring before the
  transport: a ``RateLimitError`` after the SDK's retries re-schedules the task);
* Celery's ``rate_limit="9/s"`` (per node) around a plain client, retrying
  after the provider's retry-after.

"Quota 429s" are the refusals the quota caused (the hold's own refusals are
counted apart); "used" is accepted requests per second over the run against
the limit of 9/s.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from pathlib import Path

import redis

from celery_throttle.testing import redis_server, workers
from examples.provider import MockProvider

ROOT = Path(__file__).resolve().parent.parent
HOLD_FOR = 0.5
LABELS = {"sdk_transport": "`@throttled` + `gated_client` (every request gated)",
          "sdk_anthropic": "the same through the Anthropic SDK",
          "sdk_wrapped": "`@throttled` around a plain client",
          "sdk_rate_limit": "Celery `rate_limit=\"9/s\"`, plain client"}


def _run(url: str, name: str, n: int, provider: MockProvider) -> dict[str, float]:
    bench = importlib.import_module("benchmarks.bench_app")
    for db in (5, 6, 7, 8):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    provider.reset()
    records = redis.Redis.from_url(f"{url}/8")
    env = {"BENCH_REDIS": url, "BENCH_PROVIDER": provider.url, "PYTHONPATH": str(ROOT)}
    task = bench.SDK_CONTENDERS[name]
    with workers("benchmarks.bench_app", ("s1", "s2"), concurrency=4, queues=("celery",),
                 cwd=ROOT, env=env):
        t0 = time.time()
        for i in range(n):
            task.delay(i)
        held = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(set(records.lrange(f"done:{name}", 0, -1))) < n:
            if not held and len(provider.accepted) >= n // 4:
                provider.hold(HOLD_FOR)  # calls are flowing: the provider's trouble now
                held = True
            time.sleep(0.02)
        span = time.time() - t0
    done = records.lrange(f"done:{name}", 0, -1)
    accepted = sorted(provider.accepted)
    quota = provider.quota_refusals()
    used_span = accepted[-1] - accepted[0] if len(accepted) > 1 else span
    return {"done": len(set(done)), "twice": len(done) - len(set(done)), "quota": quota,
            "hold": len(provider.refusals) - quota, "span": span,
            "used": (len(accepted) - 1) / used_span / 9}


def _cell(values: list[float], fmt: str) -> str:
    if min(values) == max(values):
        return format(values[0], fmt)
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def main(argv: list[str] | None = None) -> None:
    """Print the section's markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    provider = MockProvider(limit=10, window=1.0, latency=0.02).start()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in LABELS}
    try:
        with redis_server() as url:
            os.environ["BENCH_REDIS"], os.environ["BENCH_PROVIDER"] = url, provider.url
            for _ in range(args.runs):  # interleaved: the machine's moods hit all alike
                for name in LABELS:
                    rows[name].append(_run(url, name, args.n, provider))
    finally:
        provider.stop()
    print(f"{args.n} tasks, one SDK call each (default retries), 2 nodes x 4 "
          f"processes; quota 10 requests/s, limit 9/s; the provider refuses everything for "
          f"{HOLD_FOR:g} s once a quarter of the calls are done; {args.runs} runs each, "
          f"interleaved (ranges over the runs).\n")
    print("| wiring | done / twice | quota 429s (runs with any) | refused in the hold | "
          "used of 9/s | drain s |")
    print("|---|---|---:|---:|---:|---:|")
    for name, runs in rows.items():
        quotas = [r["quota"] for r in runs]
        with_any = sum(1 for q in quotas if q)
        print(f"| {LABELS[name]} | {_cell([r['done'] for r in runs], '.0f')} / "
              f"{_cell([r['twice'] for r in runs], '.0f')} | {_cell(quotas, '.0f')} "
              f"({with_any} of {len(runs)}) | {_cell([r['hold'] for r in runs], '.0f')} | "
              f"{_cell([r['used'] for r in runs], '.2f')} | "
              f"{statistics.median(r['span'] for r in runs):.1f} (median) |")


if __name__ == "__main__":
    main()
