"""Section 11: a quota nobody told us, learned.  Three contenders against one provider.

    python -m benchmarks.adaptive [--steady 120] [--halved 60] [--restored 90]
                                  [--only learned,local,fixed,threads]

The mock provider (examples.provider) allows L = 20 requests in any sliding
second and tells nothing: no rate-limit headers, and its 429s name no wait.
Calls take ~50 ms.  Callers: 8 processes (2 "nodes" x 4, as a prefork pool
has them), each sending one request after the other for the whole run.  The
phases: L = 20/s for ``--steady`` seconds, L halved to 10/s for ``--halved``,
then restored to 20/s for ``--restored``.  Each contender starts from a guess
of 3 L = 60/s:

* ``learned``: ``gated_client("60/s", adaptive=True)``: one learned rate in
  the store for every process (``core/lua/learn.lua``);
* ``local``: each process learns alone, as an SDK's adaptive retry mode does:
  a token bucket per client, cut by 0.7 on a refusal and grown along CUBIC
  (C = 0.4), never past twice the rate it measured itself sending;
* ``fixed``: ``gated_client("60/s")``, the guess kept: a bare 429 pauses the
  limit for 1 s on every process;
* ``threads``: ``learned`` from 8 threads of one process, each with its own
  ``gated_client(..., adaptive=True)``.

Per phase: the accepted rate over the phase after its first 30 s (over L),
the refusals and their share of the requests, the refusals in the phase's
first 30 s, and the seconds until the accepted rate (per second) first
reached 0.9 L and held it (its mean over the next 10 s >= 0.9 L).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from celery_throttle.testing import redis_server
from celery_throttle.transport import gated_client
from examples.provider import MockProvider

L = 20
GUESS = "60/s"
PROCESSES = 8
SETTLE = 30.0  # s: a phase's start left out of its steady figures


class LocalCubic:
    """One process's own adaptive limiter (an SDK's adaptive retry mode): a token bucket at
    a rate cut by BETA on a refusal, grown along CUBIC after it, capped at twice the rate
    measured sending."""

    BETA, C = 0.7, 0.4

    def __init__(self, rate: float) -> None:
        self.rate, self.w_max, self.cut_at = rate, rate, time.monotonic()
        self.next = time.monotonic()
        self.sent: list[float] = []

    def wait(self) -> None:
        now = time.monotonic()
        if self.next > now:
            time.sleep(self.next - now)
        self.next = max(self.next, time.monotonic()) + 1 / self.rate
        self.sent.append(time.monotonic())

    def answered(self, refused: bool) -> None:
        now = time.monotonic()
        self.sent = [t for t in self.sent if t > now - 1.0]
        measured = max(1.0, float(len(self.sent)))
        if refused:
            self.w_max, self.cut_at = self.rate, now
            self.rate = max(0.5, self.rate * self.BETA)
            return
        k = (self.w_max * (1 - self.BETA) / self.C) ** (1 / 3)
        cubic = self.C * (now - self.cut_at - k) ** 3 + self.w_max
        self.rate = max(0.5, min(cubic, 2 * measured, 60.0))


def _call(client: httpx.Client, url: str) -> bool:
    """One request; True when refused."""
    response = client.post(f"{url}/v1/chat/completions", timeout=10,
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    return response.status_code == 429


def _caller(contender: str, url: str, store: str, prefix: str, until: float) -> None:
    """One process (or thread) sending until ``until`` (time.time())."""
    if contender == "local":
        limiter = LocalCubic(60.0)
        with httpx.Client() as client:
            while time.time() < until:
                limiter.wait()
                limiter.answered(_call(client, url))
        return
    with gated_client(GUESS, name="bench-learn", url=store, prefix=prefix, module="httpx",
                      adaptive=contender in ("learned", "threads"), timeout=30) as client:
        while time.time() < until:
            _call(client, url)


def _run(contender: str, provider: MockProvider, store: str,
         phases: Sequence[tuple[int, float]]) -> list[tuple[float, bool]]:
    """Run the phases; the provider's log of this run: (seconds from the start, accepted)."""
    provider.reset()
    provider.set_limit(phases[0][0])
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    start = time.time() + 1.0
    until = start + sum(seconds for _, seconds in phases)
    if contender == "threads":
        callers: list[Any] = [threading.Thread(target=_caller, args=(
            contender, provider.url, store, prefix, until)) for _ in range(PROCESSES)]
    else:
        spawn = multiprocessing.get_context("spawn")
        callers = [spawn.Process(target=_caller, args=(contender, provider.url, store, prefix,
                                                        until)) for _ in range(PROCESSES)]
    for c in callers:
        c.start()
    at = start
    for limit, seconds in phases:
        time.sleep(max(0.0, at - time.time()))
        provider.set_limit(limit)
        at += seconds
    for c in callers:
        c.join(timeout=max(5.0, until - time.time() + 30))
    return [(when - start, accepted) for when, _path, accepted in provider.log
            if when >= start]


def _phase(log: list[tuple[float, bool]], begin: float, end: float, limit: int
           ) -> dict[str, float]:
    seconds = [0] * math.ceil(end - begin)
    refused = early = sent = 0
    for at, accepted in log:
        if not begin <= at < end:
            continue
        sent += 1
        if accepted:
            seconds[int(at - begin)] += 1
        else:
            refused += 1
            early += at < begin + SETTLE
    reached = math.inf
    for i in range(len(seconds)):
        ahead = seconds[i:i + 10]
        if seconds[i] >= 0.9 * limit and len(ahead) == 10 and sum(ahead) >= 9 * limit:
            reached = i + 1.0
            break
    later = [(at, ok) for at, ok in log if begin + SETTLE <= at < end]
    late_refused = sum(1 for _, ok in later if not ok)
    span = max(1e-9, end - begin - SETTLE)
    return {"used": sum(1 for _, ok in later if ok) / span / limit, "refused": refused,
            "sent": sent, "early": early,
            "late_share": late_refused / max(1, len(later)), "reached": reached}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steady", type=float, default=120.0)
    parser.add_argument("--halved", type=float, default=60.0)
    parser.add_argument("--restored", type=float, default=90.0)
    parser.add_argument("--only", default="learned,local,fixed,threads")
    args = parser.parse_args(argv)
    phases = [(L, args.steady), (L // 2, args.halved), (L, args.restored)]
    names = ("steady", "halved", "restored")
    provider = MockProvider(limit=L, window=1.0, latency=0.05, rate_headers=False,
                            retry_after=False).start()
    rows = []
    try:
        with redis_server() as store:
            for contender in args.only.split(","):
                log = _run(contender, provider, store, phases)
                at = 0.0
                for name, (limit, seconds) in zip(names, phases, strict=True):
                    rows.append((contender, name, limit, _phase(log, at, at + seconds, limit)))
                    at += seconds
    finally:
        provider.stop()
    print(f"\nL = {L} in any 1 s, no headers, bare 429s; guess 60/s; 8 callers; phases "
          f"{args.steady:g}/{args.halved:g}/{args.restored:g} s")
    print("| contender | phase | L | used after 30 s (of L) | refused (first 30 s) | "
          "refused after 30 s | to 0.9 L |")
    print("|---|---|---|---|---|---|---|")
    for contender, name, limit, fig in rows:
        reached = "never" if fig["reached"] == math.inf else f"{fig['reached']:.0f} s"
        print(f"| {contender} | {name} | {limit}/s | {fig['used']:.3f} | "
              f"{fig['refused']:.0f} of {fig['sent']:.0f} ({fig['early']:.0f}) | "
              f"{fig['late_share']:.2%} | {reached} |")


if __name__ == "__main__":
    main()
