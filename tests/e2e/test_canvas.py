"""Celery's canvas and a warm shutdown, over tasks that wait in the waiting room."""

from __future__ import annotations

import os
import signal
from collections import Counter
from types import ModuleType

import pytest
import redis
from celery import chain, chord, group

from celery_throttle.room.parking import WaitingRoom

from .. import databases
from ..workers import read_records, wait_results, worker_nodes

pytestmark = pytest.mark.integration

# Waits past 50 ms are parked: at 20/s, eight pool processes would otherwise
# pace a backlog by sleeping (the default sleeps up to 0.5 s) and park nothing.
SHORT_SLEEPS: dict[str, object] = {"throttle_max_sleep": 0.05}


def test_chord_group_and_chains_over_parked_tasks(capp: ModuleType, records: redis.Redis,
                                                  redis_base: str) -> None:
    """A chord of 30 throttled header tasks calls back once with their sum, a group's results
    come in order, and 10 chains of 4 throttled steps run each step once, in order, while
    the limit (20/s for all 90 starts) keeps most of them waiting outside the workers."""
    steady = capp.steady
    with worker_nodes(redis_base, ("w1", "w2"), conf=SHORT_SLEEPS):
        summed = chord(steady.s(i) for i in range(30))(capp.total.s())
        grouped = group(steady.s(100 + i) for i in range(20))()
        chained = [chain(steady.s(200 + k), steady.s(), steady.s(), steady.s())()
                   for k in range(10)]
        assert summed.get(timeout=60) == sum(range(30))
        assert grouped.get(timeout=60) == [100 + i for i in range(20)]
        assert [c.get(timeout=60) for c in chained] == [200 + k for k in range(10)]
        rows = read_records(records, expect=30 + 20 + 40 + 1, timeout=10)
    starts = Counter(r["i"] for r in rows if r["task"] == "tests.celery_app.steady")
    assert starts == Counter({**dict.fromkeys(range(30), 1),
                              **dict.fromkeys(range(100, 120), 1),
                              **dict.fromkeys(range(200, 210), 4)})
    assert [r["task"] for r in rows].count("tests.celery_app.total") == 1
    # They waited: 90 starts at 20/s take 4.5 s, and waits past 50 ms are parked.
    assert max(r["deferrals"] for r in rows) >= 1


def test_a_warm_shutdown_with_tasks_parked_loses_none(capp: ModuleType, records: redis.Redis,
                                                      redis_base: str) -> None:
    """SIGTERM to one of two nodes while most of a backlog waits in the room: every task runs
    exactly once (the waiting ones are dispatched to the node left), none is lost."""
    room = WaitingRoom(redis.Redis.from_url(f"{redis_base}/{databases.STORE}"), "throttle")
    with worker_nodes(redis_base, ("w1", "w2"), conf=SHORT_SLEEPS) as nodes:
        results = [capp.steady.delay(i) for i in range(60)]  # 3 s at 20/s
        read_records(records, expect=10, timeout=30)
        waiting = room.state().parked + room.lines.waiting()  # parked or in line
        # Celery's warm shutdown: SIGTERM to the node's main process, which lets its pool
        # finish the tasks it runs (a signal to the whole group kills them mid-run).
        os.kill(nodes[0].proc.pid, signal.SIGTERM)
        nodes[0].proc.wait(30)
        assert wait_results(results, timeout=60) == ["SUCCESS"] * 60
        rows = read_records(records, expect=60, timeout=10)
    room.client.close()
    assert waiting > 0  # the shutdown came while tasks waited in the room
    assert sorted(r["i"] for r in rows) == list(range(60))
