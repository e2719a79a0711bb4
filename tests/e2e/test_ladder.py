"""Waiting in RabbitMQ on the delay ladder (``room/ladder.py``): on a real node, a message
comes back to its queue when its delay has passed, never before, a broker's restart keeps
it, and a throttled backlog that waits there is held by no worker."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from celery_throttle.room.envelope import Envelope
from celery_throttle.room.ladder import RUNGS, Ladder, rung_name

from ..workers import COUNTDOWNS, check_window_bound, logs, read_records, wait_results, worker_nodes

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _confirming(url: str) -> Iterator[Any]:
    """A producer on a channel with publisher confirms, as the throttle's re-publishes use."""
    with Connection(url, transport_options={"confirm_publish": True}) as conn:
        yield conn.Producer()


def _envelope(exchange: str, routing_key: str, n: int) -> Envelope:
    return Envelope(str(n).encode(), "application/json", "utf-8", exchange, routing_key,
                    {"n": n}, {"delivery_mode": 2})


def _arrivals(url: str, queues: tuple[str, ...], expect: int,
              timeout: float) -> dict[int, tuple[str, float]]:
    """Each message's ``n`` -> the queue it was found in and when (``queues`` polled in turn
    every 5 ms, bounded)."""
    found: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + timeout
    with Connection(url) as conn:
        channel: Any = conn.channel()
        while len(found) < expect and time.monotonic() < deadline:
            got = False
            for queue in queues:
                message = channel.basic_get(queue, no_ack=True)
                if message is not None:
                    found[int(message.headers["n"])] = (queue, time.monotonic())
                    got = True
            if not got:
                time.sleep(0.005)
    return found


def test_a_message_comes_back_to_its_queue_when_its_delay_has_passed(rabbitmq_url: str) -> None:
    """Delays of 0, 5 ms, 0.3 s and 1.5 s, through a direct exchange and through the default
    one (a lane): each arrives no sooner than its delay, and soon after it."""
    name = f"ladder-{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, type="direct", durable=False, auto_delete=True)
    queues = [Queue(name, exchange, routing_key=name, auto_delete=True),
              Queue(name + ".lane", auto_delete=True)]
    ladder = Ladder()
    delays = {0: 0.0, 1: 0.005, 2: 0.3, 3: 1.5, 4: 0.3}
    with _confirming(rabbitmq_url) as producer:
        for queue in queues:
            queue(producer.channel).declare()
        ladder.ready(producer.channel, f"x:{name}")
        # (declared before the clock starts: a passive declare's answer comes after theirs)
        producer.channel.queue_declare(rung_name(RUNGS - 1), passive=True)
        sent = time.monotonic()
        for n, delay in delays.items():
            env = _envelope("", name + ".lane", n) if n == 4 else _envelope(name, name, n)
            ladder.send(producer, env, delay, {})
    got = _arrivals(rabbitmq_url, (name, name + ".lane"), 5, timeout=10)
    late = {n: round(at - sent - delays[n], 3) for n, (_, at) in got.items()}
    print(f"\nladder: arrived after its delay by (s) {late}")
    # Every one came back, to its own queue: the lane's by the default exchange's routing.
    assert {n: queue for n, (queue, _) in got.items()} == {
        0: name, 1: name, 2: name, 3: name, 4: name + ".lane"}
    assert min(late.values()) >= 0  # never before its delay
    assert max(late.values()) < 1.0


def test_the_ladder_keeps_every_waiting_message_through_the_broker_s_kill() -> None:
    """300 messages 0.5-6 s down the ladder, a third of them come down into their queue, when
    the node is SIGKILLed and started again on its data: every one arrives once the node is
    back.  (With classic queues as rungs, whose dead-lettering is unconfirmed, the 99 that
    had come down were lost, in each of two runs.)"""
    from ..conftest import _need_rabbitmq
    from ..servers import RabbitMQ

    _need_rabbitmq()
    count = 300
    with RabbitMQ() as server:
        queue = Queue("kept", Exchange("kept", type="direct"), routing_key="kept", durable=True)
        with _confirming(server.url) as producer:
            queue(producer.channel).declare()
            ladder = Ladder()
            for n in range(count):
                ladder.send(producer, _envelope("kept", "kept", n), 0.5 + 5.5 * n / count, {})
        assert _on_ladder(server.url) > 0  # they wait on the ladder, not in their queue
        # Killed once a third have come down (left unconsumed in their queue), the rest
        # still on their way.
        deadline = time.monotonic() + 10
        while _in_queue(server.url, "kept") < count // 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.kill()
        server.start()
        got = _arrivals(server.url, ("kept",), count, timeout=30)
    assert sorted(got) == list(range(count))


def _in_queue(url: str, name: str) -> int:
    with Connection(url) as conn:
        channel: Any = conn.channel()
        return int(channel.queue_declare(name, passive=True).message_count)


def _on_ladder(url: str) -> int:
    """Messages waiting on the ladder's queues now."""
    with Connection(url) as conn:
        channel: Any = conn.channel()
        total = 0
        for rung in range(RUNGS):
            with contextlib.suppress(Exception):  # (not declared yet)
                total += channel.queue_declare(rung_name(rung), passive=True).message_count
        return total


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_backlog_re_published_to_wait_waits_in_the_broker_not_in_a_worker(
    capp: ModuleType, records: redis.Redis, redis_base: str, broker: str,
) -> None:
    """60 tasks at 20/s on two nodes, re-published with countdowns (the waiting room off):
    while they wait, they are on the ladder and no worker holds one as a scheduled (ETA)
    task; each runs once, and the window bound holds."""
    app = capp.app
    conf = {**COUNTDOWNS, "throttle_max_sleep": 0.05}
    with worker_nodes(redis_base, ("w1", "w2"), conf=conf) as nodes:
        results = [capp.steady.delay(i) for i in range(60)]
        seen, replies = 0, dict[str, list[Any]]()
        deadline = time.monotonic() + 10
        while seen == 0 and time.monotonic() < deadline:
            seen = _on_ladder(app.conf.broker_url)
            if seen:
                replies = app.control.inspect(timeout=1.0).scheduled() or {}
        scheduled = sum(len(v) for v in replies.values())
        rows = read_records(records, expect=60, timeout=60)
        text = logs(nodes)
        states = wait_results(results, timeout=30)
    times = [r["t"] for r in rows]
    print(f"\nladder: {seen} waiting on it at one look, {scheduled} held by workers; "
          f"used {(len(times) - 1) / (times[-1] - times[0]) / 20:.2f} of 20/s")
    assert " ERROR" not in text
    assert seen > 0
    assert len(replies) == 2  # both nodes answered: and held none
    assert scheduled == 0
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # each once
    assert states == ["SUCCESS"] * 60
    check_window_bound(times, rate=20, burst=1, period=1.0)
