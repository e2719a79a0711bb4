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
counted apart); "used" is accepted requests per second over the run, the
hold's 0.5 s left out (nobody could be accepted then), against the limit of
9/s.  The provider also keeps a token quota (1,000 tokens in any 1 s; a
prompt costs 11 to 111); the gated clients have a token limit of 800/s,
burst 200, charged each request's estimate and settled from its usage.

Then a consumer the gate cannot see: another service spends 5 requests/s of
the same quota outside the gate (the provider keeping a token bucket of 10
refilled at 10/s, as the providers do, with no hold), beside the gated
client following the answers' headers and the plain wiring.  There "used" is
our accepted requests over what the other service left (ours and what the
bucket gave that nobody took).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import threading
import time
from pathlib import Path

import redis

from celery_throttle.testing import redis_server, workers
from examples.provider import MockProvider, RateLimited, summarize

ROOT = Path(__file__).resolve().parent.parent
HOLD_FOR = 0.5
LABELS = {"sdk_transport": "`@throttled` + `gated_client` (every request gated)",
          "sdk_anthropic": "the same through the Anthropic SDK",
          "sdk_wrapped": "`@throttled` around a plain client",
          "sdk_rate_limit": "Celery `rate_limit=\"9/s\"`, plain client"}
#: The contenders beside a consumer the gate cannot see.
HIDDEN = {"sdk_transport": "`gated_client`, following the headers",
          "sdk_wrapped": "`@throttled` around a plain client"}
OTHER_EVERY = 0.2  # the other service: 5 requests/s
TOKEN_BUDGET = 1000  # tokens in any 1 s (the gated clients' token limit: bench_app.SDK_TOKENS)


def _other(provider: MockProvider, stop: threading.Event) -> None:
    for _ in range(3000):  # bounded: 5 per second for at most 10 minutes
        if stop.wait(OTHER_EVERY):
            return
        with contextlib.suppress(RateLimited):
            summarize(provider.url, "the other service")


def _run(url: str, name: str, n: int, provider: MockProvider,
         hidden: bool = False) -> dict[str, float]:
    bench = importlib.import_module("benchmarks.bench_app")
    for db in (5, 6, 7, 8):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    provider.reset()
    records = redis.Redis.from_url(f"{url}/8")
    env = {"BENCH_REDIS": url, "BENCH_PROVIDER": provider.url, "PYTHONPATH": str(ROOT)}
    task = bench.SDK_CONTENDERS[name]
    stop = threading.Event()
    spender = threading.Thread(target=_other, args=(provider, stop))
    with workers("benchmarks.bench_app", ("s1", "s2"), concurrency=4, queues=("celery",),
                 cwd=ROOT, env=env):
        if hidden:
            spender.start()
            time.sleep(1.0)  # the other service alone first: its pace is in the bucket
        t0, wasted = time.time(), provider.wasted()
        for i in range(n):
            task.delay(i)
        held = hidden  # no hold beside the other service
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(set(records.lrange(f"done:{name}", 0, -1))) < n:
            if not held and len(provider.accepted) >= n // 4:
                provider.hold(HOLD_FOR)  # calls are flowing: the provider's trouble now
                held = True
            time.sleep(0.02)
        span, wasted = time.time() - t0, provider.wasted() - wasted
        stop.set()
        if hidden:
            spender.join(10)
    done = records.lrange(f"done:{name}", 0, -1)
    quota = provider.quota_refusals()
    row = {"done": len(set(done)), "twice": len(done) - len(set(done)), "quota": quota,
           "tokens": sum(1 for _, why in provider.refusals if why == "tokens"),
           "hold": len(provider.refusals) - quota, "span": span}
    if hidden:
        seen = [(path, ok) for t, path, ok in provider.log if t >= t0]
        ours = sum(1 for path, ok in seen if ok and path == "/v1/chat/completions")
        row.update(theirs_refused=sum(1 for path, ok in seen
                                      if not ok and path == "/v1/summarize"),
                   ours_refused=sum(1 for path, ok in seen
                                    if not ok and path == "/v1/chat/completions"),
                   used=ours / (ours + wasted))
        return row
    accepted = sorted(provider.accepted)
    used_span = accepted[-1] - accepted[0] - HOLD_FOR if len(accepted) > 1 else span
    row["used"] = (len(accepted) - 1) / used_span / 9
    return row


def _cell(values: list[float], fmt: str) -> str:
    if min(values) == max(values):
        return format(values[0], fmt)
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def _done(runs: list[dict[str, float]]) -> str:
    return (f"{_cell([r['done'] for r in runs], '.0f')} / "
            f"{_cell([r['twice'] for r in runs], '.0f')}")


def _refused(runs: list[dict[str, float]], field: str) -> str:
    counts = [r[field] for r in runs]
    return f"{_cell(counts, '.0f')} ({sum(1 for c in counts if c)} of {len(runs)})"


def main(argv: list[str] | None = None) -> None:
    """Print the section's markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    provider = MockProvider(limit=10, window=1.0, latency=0.02, token_budget=TOKEN_BUDGET,
                            token_window=1.0).start()
    shared = MockProvider(limit=10, window=1.0, latency=0.02, bucket=True).start()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in LABELS}
    beside: dict[str, list[dict[str, float]]] = {name: [] for name in HIDDEN}
    try:
        with redis_server() as url:
            os.environ["BENCH_REDIS"], os.environ["BENCH_PROVIDER"] = url, provider.url
            for _ in range(args.runs):  # interleaved: the machine's moods hit all alike
                for name in LABELS:
                    rows[name].append(_run(url, name, args.n, provider))
                for name in HIDDEN:
                    beside[name].append(_run(url, name, args.n, shared, hidden=True))
    finally:
        provider.stop()
        shared.stop()
    print(f"{args.n} tasks, one SDK call each (default retries), 2 nodes x 4 "
          f"processes; quota 10 requests/s and {TOKEN_BUDGET} tokens/s, limit 9/s (gated "
          f"clients: tokens 800/s, burst 200); the provider refuses everything for "
          f"{HOLD_FOR:g} s once a quarter of the calls are done; {args.runs} runs each, "
          f"interleaved (ranges over the runs).\n")
    print("| wiring | done / twice | quota 429s (runs with any) | of them for tokens | "
          "refused in the hold | used of 9/s | drain s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        print(f"| {LABELS[name]} | {_done(runs)} | {_refused(runs, 'quota')} | "
              f"{_cell([r['tokens'] for r in runs], '.0f')} | "
              f"{_cell([r['hold'] for r in runs], '.0f')} | "
              f"{_cell([r['used'] for r in runs], '.2f')} | "
              f"{statistics.median(r['span'] for r in runs):.1f} (median) |")
    print(f"\nBeside another service spending 5 requests/s of the same quota outside the gate "
          f"(the provider's token bucket of 10 refilled at 10/s); {args.runs} runs each.\n")
    print("| wiring | done / twice | our quota 429s (runs with any) | the other service's "
          "429s | used of what it left |")
    print("|---|---|---:|---:|---:|")
    for name, runs in beside.items():
        print(f"| {HIDDEN[name]} | {_done(runs)} | {_refused(runs, 'ours_refused')} | "
              f"{_cell([r['theirs_refused'] for r in runs], '.0f')} | "
              f"{_cell([r['used'] for r in runs], '.2f')} |")


if __name__ == "__main__":
    main()
