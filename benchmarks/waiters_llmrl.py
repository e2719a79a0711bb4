"""llmratelimiter's side of ``benchmarks.waiters``, run in a Python >= 3.12 interpreter.

    python benchmarks/waiters_llmrl.py URL N K RATE   -> one JSON line on stdout

It imports nothing of celery_throttle (llmratelimiter needs Python 3.12; the
benchmark's own interpreter may be older): N coroutines, arriving 2 ms
apart, each acquire K starts from one ``RateLimiter`` at RATE per second.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(url: str, n: int, k: int, rate: int) -> None:
    from llmratelimiter import RateLimiter
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    limiter = RateLimiter(redis=redis, model=f"bench-{time.time_ns()}", rpm=rate * 60, rps=rate)
    arrivals: list[float] = [0.0] * n
    firsts: list[float] = [0.0] * n
    starts: list[float] = []

    async def waiter(i: int) -> None:
        await asyncio.sleep(i * 0.002)
        arrivals[i] = time.time()
        for j in range(k):
            await limiter.acquire(tokens=1)
            now = time.time()
            starts.append(now)
            if j == 0:
                firsts[i] = now

    await asyncio.gather(*(waiter(i) for i in range(n)))
    await redis.aclose()
    print(json.dumps({"starts": starts, "arrivals": arrivals, "firsts": firsts}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
