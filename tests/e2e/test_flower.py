"""Flower beside a worker: a waiting task shows THROTTLED there, a purged one DROPPED.

A real ``celery flower`` process reads the worker's task events; its HTTP API
(``/api/tasks``) serves the states its pages show.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_throttle.integration.runtime import runtime_for

from ..workers import app_command, throttle_cli, wait_results, worker_nodes

pytestmark = pytest.mark.integration


def _tasks(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/tasks", timeout=10) as response:
        found: dict[str, dict[str, Any]] = json.loads(response.read())
    return found


@contextlib.contextmanager
def _flower(redis_base: str) -> Iterator[str]:
    """``celery -A tests.celery_app flower`` on a free loopback port, its API open."""
    with app_command(["flower", "--address=127.0.0.1"], redis_base,
                     {"FLOWER_UNAUTHENTICATED_API": "true"}, what="flower", ready=_tasks) as url:
        yield url


def _states(url: str, ids: list[str]) -> dict[str, str]:
    tasks = _tasks(url)
    return {task_id: str(tasks.get(task_id, {}).get("state")) for task_id in ids}


def test_flower_shows_waiting_tasks_throttled_and_purged_ones_dropped(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Eight tasks at 1/s on a node sending task events: Flower shows the ones waiting in
    line as THROTTLED, with their name; after `celery throttle purge --yes` those show
    DROPPED (the result backend says REVOKED), and the ones that ran SUCCESS.  Alike
    whether a pool process put them in line (the second, into an empty line) or the
    node's main process did as they arrived (the rest, which sends Celery's
    task-received event itself)."""
    conf: dict[str, object] = {"worker_send_task_events": True}
    line = runtime_for(capp.app).room.lines
    with _flower(redis_base) as url, worker_nodes(redis_base, ("w1",), conf=conf) as nodes:
        # Two first (one runs, one waits in line), the rest once the line is there: a
        # node lines a task up as it arrives only behind a line (arrival.py), and eight
        # sent at once can all reach it before any waits.
        results = [capp.patient.delay(i) for i in range(2)]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not line.next_in_line(1, "patient"):
            time.sleep(0.05)
        assert line.next_in_line(1, "patient"), "the second task never waited in line"
        results += [capp.patient.delay(i) for i in range(2, 8)]
        ids = [r.id for r in results]
        deadline = time.monotonic() + 20
        waiting: list[str] = []
        while time.monotonic() < deadline and len(waiting) < 4:
            waiting = [t for t, s in _states(url, ids).items() if s == "THROTTLED"]
            time.sleep(0.2)
        assert len(waiting) >= 4, _states(url, ids)
        tasks = _tasks(url)
        assert {tasks[t]["name"] for t in waiting} == {"tests.celery_app.patient"}
        text = nodes[0].log_text()
        assert "/MainProcess] throttle: task tests.celery_app.patient" in text
        assert re.search(r"/ForkPoolWorker-\d+\] throttle: task tests\.celery_app\.patient"
                         r"\[[-\w]+\] waits in line", text)
        purged = throttle_cli(["purge", "--yes"], redis_base)
        assert purged.returncode == 0, purged.stderr
        states = wait_results(results, timeout=20)
        deadline = time.monotonic() + 10
        shown = _states(url, ids)
        while time.monotonic() < deadline and (
                sorted(shown.values()).count("DROPPED") < states.count("REVOKED")):
            time.sleep(0.2)
            shown = _states(url, ids)
    dropped = {t for t, s in shown.items() if s == "DROPPED"}
    revoked = {r.id for r in results if r.state == "REVOKED"}
    print(f"\nflower: {len(waiting)} THROTTLED before the purge, then {shown}")
    assert revoked, states  # the purge dropped tasks that waited in line
    assert dropped == revoked
    assert {shown[t] for t in ids if t not in dropped} == {"SUCCESS"}
