"""Live limits on a real Redis: a rate set at run time reaches decisions and the dispatch."""

from __future__ import annotations

import time

import pytest
import redis

from celery_throttle import Concurrency, Gate, Limit, parse_rate
from celery_throttle.core.live import LiveLimits
from celery_throttle.room.entries import Served
from celery_throttle.room.lines import Lines

from ..clock import StepClock


def test_set_applies_to_every_key_value_and_unset_restores_the_code(
        client: redis.Redis, prefix: str) -> None:
    """An override replaces rate and burst of its name (per-key too), caps the cost, and
    other names and concurrency limits pass through unchanged."""
    live = LiveLimits(client, prefix, refresh=0.0)
    code: list[Limit | Concurrency] = [
            Limit("api", parse_rate("2/s"), burst=8, key="acme", cost=6),
            Limit("other", parse_rate("1/s")), Concurrency("api", 2)]
    assert live.apply(code) == code
    live.set("api", "20/s", burst=5)
    applied = live.apply(code)
    assert applied[0] == Limit("api", parse_rate("20/s"), burst=5, key="acme", cost=5)
    assert applied[1:] == code[1:]
    assert live.read() == {"api": (parse_rate("20/s"), 5)}
    assert live.unset("api")
    assert not live.unset("api")
    assert live.apply(code) == code


def test_a_process_sees_a_change_within_its_refresh(client: redis.Redis, prefix: str) -> None:
    """The copy is read at most once per refresh: a change shows after it, not before."""
    clock = StepClock()
    live = LiveLimits(client, prefix, refresh=0.3, clock=clock)
    limit = Limit("api", parse_rate("2/s"))
    assert live.apply([limit]) == [limit]
    LiveLimits(client, prefix).set("api", "10/s")
    clock.us += 299_000
    assert live.apply([limit]) == [limit]  # the copy is fresh
    clock.us += 10_000
    assert live.apply([limit]) == [Limit("api", parse_rate("10/s"))]


def test_bad_input_is_refused_naming_it(client: redis.Redis, prefix: str) -> None:
    """A bad rate, burst or name raises naming the value, and writes nothing."""
    live = LiveLimits(client, prefix)
    with pytest.raises(ValueError, match="fast"):
        live.set("api", "fast")
    with pytest.raises(ValueError, match="burst"):
        live.set("api", "1/s", burst=0)
    with pytest.raises(ValueError, match="limit name"):
        live.set("", "1/s")
    assert live.read() == {}


def test_waiting_tasks_are_dispatched_at_the_live_rate(client: redis.Redis,
                                                      prefix: str) -> None:
    """Ten tasks in line at 1/s leave at 20/s once the limit is set to 20/s."""
    lines = Lines(client, prefix)
    limit = Limit("api", parse_rate("1/s"))
    sec, usec = client.time()
    now = int(sec) * 1_000_000 + int(usec)
    for i in range(10):
        lines.enqueue(f"e{i}", b"m", f"t{i}", limits=[limit], blocking=limit,
                      place_us=now + i)
    LiveLimits(client, prefix).set("api", "20/s")
    out: list[Served] = []
    start = time.monotonic()
    while len(out) < 10 and time.monotonic() - start < 3:
        wait, served = lines.serve_due(50, 60_000_000)
        out += served
        if not served:
            time.sleep(min(wait or 0.01, 0.05))
    assert len(out) == 10
    assert time.monotonic() - start < 1.5  # 9 intervals of 50 ms, not 9 s


def test_resume_ends_a_pause_now(client: redis.Redis, prefix: str) -> None:
    """A paused limit admits nothing; resume admits again at once and reports it."""
    gate = Gate(client, prefix=prefix)
    limits = [Limit("api", parse_rate("10/s"), burst=5)]
    gate.pause(limits, 60)
    assert not gate.acquire_many(limits).allowed
    assert gate.resume(limits) == 1
    assert gate.acquire_many(limits).allowed
    assert gate.resume(limits) == 0
    seats = [Concurrency("seats", 1)]
    gate.pause(seats, 60)
    assert not gate.acquire_many(seats, holder="h").allowed
    assert gate.resume(seats) == 1
    assert gate.acquire_many(seats, holder="h").allowed
    gate.close()
