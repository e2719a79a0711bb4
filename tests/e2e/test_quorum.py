"""RabbitMQ quorum queues (``task_default_queue_type = "quorum"``): the waiting room's lanes,
the countdown path and a concurrency seat's hand-off, on the suite's real RabbitMQ."""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery

from ..workers import (
    COUNTDOWNS,
    check_window_bound,
    logs,
    read_records,
    wait_in_line,
    wait_results,
    worker_nodes,
)

pytestmark = pytest.mark.integration

#: The queue of these tests (its own name: a queue's type cannot change once declared).
QUEUE = "quorum"
QUORUM: dict[str, object] = {"task_default_queue": QUEUE, "task_default_queue_type": "quorum",
                             # The test store keeps nothing on disk and is not the broker:
                             # by default waits would take the countdown path.
                             "throttle_waiting_room": "always",
                             # Waits past 50 ms wait outside the workers.
                             "throttle_max_sleep": 0.05}


@pytest.fixture
def producer(broker: str, capp: ModuleType) -> Iterator[Celery]:
    """An app of the test app's settings, publishing to the quorum queue; the queue and its
    lane start empty."""
    from kombu import Connection

    url = capp.app.conf.broker_url
    with Connection(url) as conn:
        for name in (QUEUE, QUEUE + ".dispatched"):
            channel: Any = conn.channel()
            with contextlib.suppress(Exception):  # never declared yet: nothing to purge
                channel.queue_purge(name)
            with contextlib.suppress(Exception):
                channel.close()
    app = Celery("ct_tests", broker=url, backend=capp.app.conf.result_backend,
                 set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, task_default_queue_type="quorum")
    yield app
    app.close()


def _is_quorum(url: str, name: str) -> bool:
    """``name`` exists as a quorum queue: declared again as one, it is accepted; as a classic
    queue, refused for its type."""
    from kombu import Connection

    def declare(kind: str) -> str:
        with Connection(url) as conn:
            channel: Any = conn.channel()
            try:
                channel.queue_declare(name, durable=True, auto_delete=False,
                                      arguments={"x-queue-type": kind})
            except Exception as exc:
                return str(exc)
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
        return ""

    return declare("quorum") == "" and "x-queue-type" in declare("classic")


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
@pytest.mark.parametrize("path", ["waiting room", "countdown"])
def test_a_backlog_on_a_quorum_queue_runs_once_within_the_bound(
    capp: ModuleType, records: redis.Redis, redis_base: str, broker: str, producer: Celery,
    path: str,
) -> None:
    """60 tasks at 20/s on two nodes consuming a quorum queue: each runs once, the window
    bound holds, and the dispatched tasks' lane is a quorum queue too.  On the countdown
    path the re-published copies wait on the delay ladder (``room/ladder.py``), held by no
    worker, and come back by the lane (Celery's native delayed delivery takes only topic
    exchanges, and the default queue's is direct)."""
    conf = dict(QUORUM)
    if path == "countdown":
        conf.update(COUNTDOWNS)
    with worker_nodes(redis_base, ("w1", "w2"), conf=conf, queues=(QUEUE,)) as nodes:
        results = [producer.send_task("tests.celery_app.steady", (i,)) for i in range(60)]
        rows = read_records(records, expect=60, timeout=60)
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    times = [r["t"] for r in rows]
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # each once
    assert states == ["SUCCESS"] * 60
    worst = check_window_bound(times, rate=20, burst=1, period=1.0)
    used = (len(times) - 1) / (times[-1] - times[0]) / 20
    waited = sum(1 for r in rows if r["deferrals"])
    print(f"\nquorum queue, {path}: used {used:.2f} of 20/s, worst windows {worst}, "
          f"{waited} waited")
    assert waited >= 30
    assert {r["queue"] for r in rows} <= {QUEUE, QUEUE + ".dispatched"}
    if path == "waiting room":
        assert _is_quorum(capp.app.conf.broker_url, QUEUE + ".dispatched")
        assert used >= 0.85
    assert " ERROR" not in text


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_freed_seat_is_handed_over_on_a_quorum_queue(
    capp: ModuleType, records: redis.Redis, redis_base: str, broker: str, producer: Celery,
) -> None:
    """concurrency=1 on a quorum queue: the waiters start in their order, each once the
    last has ended."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=QUORUM, queues=(QUEUE,)):
        first = producer.send_task("tests.celery_app.one_seat", (1.0,))
        read_records(records, expect=1, timeout=10)  # the first holds the seat
        waiters = []
        for k in range(4):
            waiters.append(producer.send_task("tests.celery_app.one_seat", (0.3,)))
            wait_in_line(redis_base, k + 1, timeout=10)  # they wait in this order
        states = wait_results([first, *waiters], timeout=30)
        rows = read_records(records, expect=5, timeout=5)
    assert states == ["SUCCESS"] * 5
    assert [r["id"] for r in rows] == [first.id] + [w.id for w in waiters]
    gaps = [b["t"] - (a["t"] + a["seconds"]) for a, b in itertools.pairwise(rows)]
    print(f"\nquorum queue: hand-off gaps {[round(g, 3) for g in gaps]}")
    assert min(gaps) > 0  # never two at once
    assert max(gaps) < 0.5
