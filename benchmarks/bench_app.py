"""The contenders, as Celery tasks run by real worker processes (``python -m benchmarks``).

Every task records the moment it would call the provider (its start) in a
Redis list; the runner judges only from those records.  Each contender is a
task at the same limit, RATE per second, burst 1:

* ``ours``: ``@throttled``;
* ``celery_rate_limit``: Celery's built-in ``rate_limit`` (per worker node);
* the usual hand-written Redis limiters, wrapped in a task that retries
  with a countdown when denied (``max_retries=None``, so none fails):
  ``check_then_incr`` (read, compare, INCR: two calls),
  ``incr_then_check`` (its fix: INCR, compare; a fixed window),
  ``zset_separate_calls`` (a sliding window: ZREMRANGEBYSCORE, ZCARD, ZADD
  as three calls), ``fixed_window_lua`` (a fixed-window Lua script) and
  ``inprocess_leaky`` (a leaky bucket in each process's memory);
* ``limits_moving_window`` (the ``limits`` library, Redis moving window) and
  ``pyrate_redis`` (``pyrate-limiter``'s Redis bucket), retrying likewise.

Configured from the environment: BENCH_REDIS (server URL; broker db 5,
store db 6, results db 7, records db 8), BENCH_RATE, BENCH_MAX_SLEEP,
BENCH_WAITING_ROOM, BENCH_KEEP and BENCH_GC_FREEZE ("0" or "1"),
BENCH_STORE (a store of its own instead of db 6);
section 4 (calls in flight): BENCH_PROVIDER, BENCH_CALL_SECONDS, BENCH_LEASE; the SDK
section: BENCH_PROVIDER.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

# The SDKs take 1.7-2.1 s to import: here, in the parent the pool forks, not in a
# task's first call (whose admission would go stale meanwhile).
import anthropic
import openai
import redis
from celery import Celery, Task

import celery_throttle
from celery_throttle import throttled

REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")
RATE = int(os.environ.get("BENCH_RATE", "10"))

app = Celery("bench", broker=f"{REDIS}/5", backend=f"{REDIS}/7")
app.conf.update(
    throttle_redis_url=f"{REDIS}/6",
    broker_connection_retry_on_startup=True,
    result_expires=600,
    worker_hijack_root_logger=False,
)
if os.environ.get("BENCH_MAX_SLEEP"):
    app.conf.throttle_max_sleep = float(os.environ["BENCH_MAX_SLEEP"])
if os.environ.get("BENCH_GC_FREEZE"):  # "0": off (benchmarks/pool_memory.py's control)
    app.conf.throttle_gc_freeze = os.environ["BENCH_GC_FREEZE"] == "1"
if os.environ.get("BENCH_WAITING_ROOM"):  # "0": the countdown path; default: the room
    app.conf.throttle_waiting_room = os.environ["BENCH_WAITING_ROOM"] == "1"
if os.environ.get("BENCH_STORE"):  # a throttle store of its own (benchmarks/outage.py)
    app.conf.throttle_redis_url = os.environ["BENCH_STORE"]
if os.environ.get("BENCH_KEEP"):  # "1": waiting tasks kept beside the broker's queues
    app.conf.throttle_keep_beside_broker = os.environ["BENCH_KEEP"] == "1"
celery_throttle.install(app)

_store = redis.Redis.from_url(f"{REDIS}/6")
_records = redis.Redis.from_url(f"{REDIS}/8")


def record(task: Task[Any, Any], contender: str, **extra: Any) -> None:
    """Append this start (the provider call) to the contender's list."""
    header = (task.request.headers or {}).get(celery_throttle.HEADER) or {}
    _records.rpush(f"starts:{contender}", json.dumps({
        "t": time.time(), "id": task.request.id,
        "retries": task.request.retries, "deferrals": header.get("deferrals", 0), **extra}))


def _retry(task: Task[Any, Any], countdown: float) -> None:
    # The tasks are declared with max_retries=None (retry forever): passing
    # max_retries=None to retry() itself would mean "the task's default", 3.
    raise task.retry(countdown=max(0.01, countdown))


@throttled(f"{RATE}/s", name="bench-ours")
@app.task(bind=True)
def ours(self: Task[Any, Any], i: int) -> int:
    """@throttled: the over-limit task waits for its booked start."""
    record(self, "ours", i=i)
    return i


@app.task(bind=True, rate_limit=f"{RATE}/s")
def celery_rate_limit(self: Task[Any, Any], i: int) -> int:
    """Celery's own rate_limit: a token bucket in each worker node."""
    record(self, "celery_rate_limit")
    return i


def _window() -> tuple[int, float]:
    now = time.time()
    return int(now), 1.0 - (now - int(now))  # this 1 s window, and the time left in it


@app.task(bind=True, max_retries=None)
def check_then_incr(self: Task[Any, Any], i: int) -> int:
    """Check then increment: read the count, compare, then INCR (two calls)."""
    window, left = _window()
    key = f"bench:cti:{window}"
    if int(_store.get(key) or 0) >= RATE:
        _retry(self, left)
    _store.incr(key)
    _store.expire(key, 2)
    record(self, "check_then_incr")
    return i


@app.task(bind=True, max_retries=None)
def incr_then_check(self: Task[Any, Any], i: int) -> int:
    """Its fix: INCR first and judge the returned count (atomic, fixed window)."""
    window, left = _window()
    key = f"bench:itc:{window}"
    hits = _store.incr(key)
    _store.expire(key, 2)
    if hits > RATE:
        _retry(self, left)
    record(self, "incr_then_check")
    return i


@app.task(bind=True, max_retries=None)
def zset_separate_calls(self: Task[Any, Any], i: int) -> int:
    """A sliding window in a sorted set, with three separate calls."""
    key = "bench:zset"
    now = time.time()
    _store.zremrangebyscore(key, "-inf", now - 1.0)
    if _store.zcard(key) >= RATE:
        _retry(self, 1.0 / RATE)
    _store.zadd(key, {f"{now}:{self.request.id}": now})
    _store.expire(key, 2)
    record(self, "zset_separate_calls")
    return i


_FIXED_WINDOW = _store.register_script("""
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local count = redis.call('GET', key)
if not count then
    redis.call('SET', key, 1)
    redis.call('EXPIRE', key, math.ceil(window / 1000))
    return {1, 1}
else
    count = tonumber(count)
    if count < limit then
        redis.call('INCR', key)
        return {0, count + 1}
    else
        return {1, count}
    end
end
""")


@app.task(bind=True, max_retries=None)
def fixed_window_lua(self: Task[Any, Any], i: int) -> int:
    """A fixed-window Lua script, as such limiters are commonly published.

    Its first request of a window returns {1, 1} ("blocked") although it
    counts it; the article's caller treats element 1 == 1 as blocked, so that
    slot is wasted.  Kept: the benchmark measures the pattern as published.
    """
    blocked, _count = _FIXED_WINDOW(keys=["bench:lua"], args=[int(time.time() * 1000), 1000, RATE])
    if blocked == 1:
        _retry(self, max(0.01, _store.pttl("bench:lua") / 1000))
    record(self, "fixed_window_lua")
    return i


_bucket = {"level": 0.0, "at": time.monotonic()}


@app.task(bind=True, max_retries=None)
def inprocess_leaky(self: Task[Any, Any], i: int) -> int:
    """A leaky bucket (capacity 1, leaking RATE per second) in this process's memory."""
    now = time.monotonic()
    _bucket["level"] = max(0.0, _bucket["level"] - (now - _bucket["at"]) * RATE)
    _bucket["at"] = now
    if _bucket["level"] + 1 > 1:
        _retry(self, (_bucket["level"] + 1 - 1) / RATE)
    _bucket["level"] += 1
    record(self, "inprocess_leaky")
    return i


_limits: Any = None


@app.task(bind=True, max_retries=None)
def limits_moving_window(self: Task[Any, Any], i: int) -> int:
    """The limits library's moving window on Redis; retries until its window resets."""
    global _limits
    from limits import parse, storage, strategies  # a bench-only dependency

    if _limits is None:
        _limits = (strategies.MovingWindowRateLimiter(storage.RedisStorage(f"{REDIS}/6")),
                   parse(f"{RATE}/second"))
    limiter, item = _limits
    if not limiter.hit(item, "bench"):
        reset = limiter.get_window_stats(item, "bench").reset_time
        _retry(self, reset - time.time())
    record(self, "limits_moving_window")
    return i


_pyrate: Any = None


@app.task(bind=True, max_retries=None)
def pyrate_redis(self: Task[Any, Any], i: int) -> int:
    """pyrate-limiter's Redis bucket, non-blocking; retries after one interval."""
    global _pyrate
    from pyrate_limiter import Duration, Limiter, Rate, RedisBucket

    if _pyrate is None:
        bucket = RedisBucket.init([Rate(RATE, Duration.SECOND)],
                                  redis.Redis.from_url(f"{REDIS}/6"), "bench:pyrate")
        _pyrate = Limiter(bucket)
    if not _pyrate.try_acquire("bench", blocking=False):
        _retry(self, 1.0 / RATE)
    record(self, "pyrate_redis")
    return i


# --- Section 4: calls in flight against the mock provider (BENCH_PROVIDER) ---

PROVIDER = os.environ.get("BENCH_PROVIDER", "http://127.0.0.1:9")
INFLIGHT = 4
CALL_SECONDS = float(os.environ.get("BENCH_CALL_SECONDS", "0.5"))
LEASE = float(os.environ.get("BENCH_LEASE", "30"))


def _call(task: Task[Any, Any], contender: str) -> None:
    """Record the attempt, then call the provider (a 429 raises provider.RateLimited)."""
    from examples import provider

    header = (task.request.headers or {}).get(celery_throttle.HEADER) or {}
    _records.rpush(f"calls:{contender}", json.dumps({
        "t": time.time(), "id": task.request.id, "retries": task.request.retries,
        "deferrals": header.get("deferrals", 0)}))
    provider.summarize(PROVIDER, "x" * 40, work=CALL_SECONDS)
    _records.rpush(f"done:{contender}", str(task.request.id))


@throttled(concurrency=INFLIGHT, name="bench-inflight", lease=LEASE)
@app.task(bind=True)
def inflight_ours(self: Task[Any, Any], i: int) -> int:
    """``@throttled(concurrency=4)``: a lease per call; a 429 would pause every worker."""
    from examples import provider

    try:
        _call(self, "inflight_ours")
    except provider.RateLimited as exc:
        raise celery_throttle.RateLimited(exc.retry_after) from None
    return i


@app.task(bind=True, max_retries=None)
def inflight_retry(self: Task[Any, Any], i: int) -> int:
    """No limit: call, and on a 429 retry after the provider's Retry-After (the usual loop)."""
    from examples import provider

    try:
        _call(self, "inflight_retry")
    except provider.RateLimited as exc:
        _retry(self, exc.retry_after)
    return i


@app.task(bind=True, max_retries=None)
def inflight_counter(self: Task[Any, Any], i: int) -> int:
    """A hand-written Redis semaphore (INCR, DECR in finally), retrying after 0.1 s."""
    if _store.incr("bench:inflight") > INFLIGHT:
        _store.decr("bench:inflight")
        _retry(self, 0.1)
    try:
        _call(self, "inflight_counter")
    finally:  # a killed worker never gets here: its booked start is gone for good
        _store.decr("bench:inflight")
    return i


# Section "SDK retries": an OpenAI SDK call per task (default retries on) under a
# quota of 10/s, the limit at SDK_RATE, and a token quota of 1,000 in any 1 s, the gated
# clients' token limit at SDK_TOKENS (burst + rate <= 1,000: no 1 s window holds more).
# One client per process and contender.
SDK_RATE = "9/s"
SDK_TOKENS = ("800/s", 200)
_sdk: dict[str, Any] = {}


def _sdk_client(contender: str, gated: bool) -> Any:
    if contender not in _sdk:
        from celery_throttle.transport import gated_client

        tokens = celery_throttle.Limit(f"bench-{contender}-tokens",
                                       celery_throttle.parse_rate(SDK_TOKENS[0]),
                                       burst=SDK_TOKENS[1])
        http = (gated_client(SDK_RATE, name=f"bench-{contender}", url=f"{REDIS}/6",
                             tokens=tokens) if gated else None)
        _sdk[contender] = (
            anthropic.Anthropic(base_url=PROVIDER, api_key="sk-bench", http_client=http)
            if "anthropic" in contender else
            openai.OpenAI(base_url=f"{PROVIDER}/v1", api_key="sk-bench", http_client=http))
    return _sdk[contender]


def _chat(task: Task[Any, Any], contender: str, gated: bool) -> None:
    """One SDK call; a refusal the SDK's retries could not get past re-schedules the task
    (the documented wiring: RateLimited reads the SDK error's retry-after)."""
    client = _sdk_client(contender, gated)
    # Prompts of 11 to 111 tokens (the provider counts characters / 4).
    task_id = str(task.request.id)
    text = f"document {task_id} " + "x" * (int(task_id[:2], 16) % 5 * 100)
    prompt = [{"role": "user", "content": text}]
    try:
        if "anthropic" in contender:
            client.messages.create(model="mock", max_tokens=16, messages=prompt)
        else:
            client.chat.completions.create(model="mock", messages=prompt)
    except (openai.RateLimitError, anthropic.RateLimitError) as exc:
        raise celery_throttle.RateLimited(exc) from None
    _records.rpush(f"done:{contender}", str(task.request.id))


@throttled(SDK_RATE, name="bench-sdk_transport")
@app.task(bind=True)
def sdk_transport(self: Task[Any, Any], i: int) -> int:
    """``@throttled`` and a gated client: every request, SDK retries included, waits."""
    _chat(self, "sdk_transport", gated=True)
    return i


@throttled(SDK_RATE, name="bench-sdk_anthropic")
@app.task(bind=True)
def sdk_anthropic(self: Task[Any, Any], i: int) -> int:
    """``@throttled`` and a gated client, through the Anthropic SDK."""
    _chat(self, "sdk_anthropic", gated=True)
    return i


@throttled(SDK_RATE, name="bench-sdk_wrapped")
@app.task(bind=True)
def sdk_wrapped(self: Task[Any, Any], i: int) -> int:
    """``@throttled`` around a plain client (the documented wiring before the transport)."""
    _chat(self, "sdk_wrapped", gated=False)
    return i


@app.task(bind=True, max_retries=None, rate_limit=SDK_RATE)
def sdk_rate_limit(self: Task[Any, Any], i: int) -> int:
    """Celery's ``rate_limit`` (per node) and a plain client, retrying after a 429."""
    try:
        _chat(self, "sdk_rate_limit", gated=False)
    except celery_throttle.RateLimited as exc:  # the SDK's RateLimitError, read
        _retry(self, exc.retry_after)
    return i


SDK_CONTENDERS = {"sdk_transport": sdk_transport, "sdk_anthropic": sdk_anthropic,
                  "sdk_wrapped": sdk_wrapped, "sdk_rate_limit": sdk_rate_limit}

INFLIGHT_CONTENDERS = {"inflight_ours": inflight_ours, "inflight_counter": inflight_counter,
                       "inflight_retry": inflight_retry}

CONTENDERS = {
    "ours": ours, "celery_rate_limit": celery_rate_limit,
    "check_then_incr": check_then_incr, "incr_then_check": incr_then_check,
    "zset_separate_calls": zset_separate_calls, "fixed_window_lua": fixed_window_lua,
    "inprocess_leaky": inprocess_leaky, "limits_moving_window": limits_moving_window,
    "pyrate_redis": pyrate_redis,
}
