"""Lining a task up as it arrives, in a worker's main process: real Redis as broker and store.

The consumer here is a stand-in for Celery's (its host name, its event
dispatcher, its prefetch count and timer): what ``arrival.py`` reads of it.
The messages are real ones, published by Celery and received through kombu.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
from celery import Celery, Task
from celery.utils.imports import symbol_by_name
from kombu import Connection
from kombu.message import Message

from celery_throttle import HEADER, Limit, parse_rate, throttled
from celery_throttle.integration.arrival import (
    HANDOFF_MAX_S,
    HANDOFF_S,
    _Arrivals,
    lines_up,
    strategy,
)
from celery_throttle.integration.hooks import ORIGINAL_STRATEGY
from celery_throttle.integration.runtime import runtime_for
from celery_throttle.room.entries import entry_id
from celery_throttle.room.envelope import Envelope
from celery_throttle.room.header import START
from celery_throttle.room.lines import MAX_AHEAD_US

from .. import databases
from ..conftest import installed_app

RATE = "1/s"


class _Qos:
    """The consumer's prefetch count, as ``hold`` moves it."""

    def __init__(self) -> None:
        self.raised = 0

    def increment_eventually(self) -> None:
        self.raised += 1

    def decrement_eventually(self) -> None:
        self.raised -= 1


class _Timer:
    """The consumer's timer: what was scheduled, run by the test."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Any, int]] = []

    def call_after(self, seconds: float, fun: Any, priority: int = 0) -> None:
        self.calls.append((seconds, fun, priority))


def _consumer() -> Any:
    return SimpleNamespace(hostname="w1@test", event_dispatcher=None, connection_errors=(),
                           qos=_Qos(), timer=_Timer())


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    with installed_app("arrival", redis_url, prefix) as a:
        yield a


def _task(app: Celery) -> Task[Any, Any]:
    @throttled(RATE, name="arrive", max_wait=600)
    @app.task(name="arrival.summarize", bind=True, shared=False)
    def summarize(self: Task[Any, Any], document: int) -> int:
        return document

    return summarize


def _received(app: Celery, task: Task[Any, Any], *args: Any, **options: Any) -> Message:
    """``task``'s message as a worker receives it."""
    with Connection(app.conf.broker_url) as conn:
        queue = conn.SimpleQueue("arrival-q")
        queue.clear()
        task.apply_async(args, queue="arrival-q", **options)
        message: Message = queue.get(timeout=5)
        message.ack()
        queue.close()
    return message


def _someone_in_line(app: Celery) -> None:
    limit = Limit("arrive", parse_rate(RATE))
    room = runtime_for(app).room
    sec, usec = room.client.time()
    room.enqueue("before:-", b"\x01m", "before", limits=[limit], blocking=limit,
                 place_us=int(sec) * 1_000_000 + int(usec))


def test_a_task_arriving_behind_tasks_in_line_joins_them_as_it_was_sent(app: Celery) -> None:
    """Behind a task in line, the message waits in line (no pool run): second in line, its
    own message stored with the wait's header, its THROTTLED state in the result backend."""
    app.conf.update(
        result_backend=app.conf.broker_url.rsplit("/", 1)[0] + f"/{databases.SCRATCH}")
    task = _task(app)
    _someone_in_line(app)
    message = _received(app, task, 7, priority=3)
    task_id = message.headers["id"]
    assert _Arrivals(task, _consumer()).lined_up(message)
    room = runtime_for(app).room
    first, second = room.lines.next_in_line(2, "arrive")
    assert (first.entry, second.entry) == ("before:-", entry_id(task_id))
    stored = Envelope.loads(second.message)
    assert stored.body == cast(bytes, message.body)
    assert stored.routing_key == "arrival-q"
    assert stored.properties["priority"] == 3
    header = stored.headers[HEADER]
    assert header["entry"] == entry_id(task_id)
    assert header["deferrals"] == 1
    assert header["since"] > 0
    assert stored.headers["id"] == task_id
    assert str(app.AsyncResult(task_id).state) == "THROTTLED"
    assert app.AsyncResult(task_id).info["limit"] == "arrive"
    # Delivered again (a connection lost before the acknowledgement): it waits once.
    assert _Arrivals(task, _consumer()).lined_up(message)
    assert len(room.lines.next_in_line(10, "arrive")) == 2


def test_a_task_whose_line_is_empty_goes_on_to_the_pool_and_nothing_is_written(
        app: Celery, client: redis.Redis) -> None:
    """With no task in line the gate decides in the pool process, as without the setting;
    so do a copy dispatched from the line and a message with an ETA."""
    task = _task(app)
    arrivals = _Arrivals(task, _consumer())
    assert not arrivals.lined_up(_received(app, task, 1))
    assert client.hlen(runtime_for(app).room.lines.messages) == 0
    _someone_in_line(app)
    dispatched = _received(app, task, 2, headers={HEADER: {"entry": "x:-", "deferrals": 1}})
    assert not arrivals.lined_up(dispatched)
    assert not arrivals.lined_up(_received(app, task, 3, countdown=30))
    assert len(runtime_for(app).room.lines.next_in_line(10, "arrive")) == 1


def test_a_store_that_fails_sends_arrivals_to_the_pool_for_a_while(
        redis_url: str, prefix: str) -> None:
    """The store down: the message goes on to the pool (its store-down policy decides), and
    the consumer stops asking for a few seconds rather than wait on it per message."""
    with installed_app("arrival-down", redis_url, prefix,
                       throttle_redis_url="redis://127.0.0.1:1/0") as down:
        task = _task(down)
        message = _received(down, task, 1)
        arrivals = _Arrivals(task, _consumer())
        assert not arrivals.lined_up(message)
        assert arrivals.paused_until > 0


def test_with_the_scheduler_every_worker_lines_tasks_up_on_arrival(app: Celery) -> None:
    assert lines_up(app) is True


def test_the_stored_message_runs_the_task_it_was(app: Celery) -> None:
    """What waits in line is the task's own message: its arguments read back as sent."""
    task = _task(app)
    _someone_in_line(app)
    message = _received(app, task, 42)
    assert _Arrivals(task, _consumer()).lined_up(message)
    (_, mine) = runtime_for(app).room.lines.next_in_line(2, "arrive")
    stored = Envelope.loads(mine.message)
    args, kwargs, _ = json.loads(stored.body)
    assert (args, kwargs) == ([42], {})


def test_without_the_waiting_room_no_task_is_lined_up_on_arrival(redis_url: str,
                                                                 prefix: str) -> None:
    """With the waiting room off no task waits in a line: arrivals are not looked at."""
    with installed_app("arrival-off", redis_url, prefix, throttle_waiting_room=False) as a:
        assert lines_up(a) is False


def test_a_gated_task_s_messages_reach_this_strategy_and_then_its_own(app: Celery) -> None:
    """Celery builds a task's message handler from its ``Strategy``: the gated task's names
    the arrival strategy, which keeps the task's own (Celery's default here)."""
    task = _task(app)
    assert symbol_by_name(task.Strategy) is strategy
    assert task.__dict__[ORIGINAL_STRATEGY] == "celery.worker.strategy:default"


def _dispatched(app: Celery, task: Task[Any, Any], ahead_us: int, charged: str = "c",
                spacing: tuple[int, ...] = ()) -> Message:
    """A copy dispatched from the line for a start ``ahead_us`` from now on the store's clock
    (``spacing``: its limits' intervals, us)."""
    sec, usec = runtime_for(app).room.client.time()
    start = int(sec) * 1_000_000 + int(usec) + ahead_us
    return _received(app, task, 1, headers={HEADER: {"entry": "x:-", "deferrals": 1,
                                                     "charged": charged, START: start,
                                                     "spacing": list(spacing)}})


def test_a_charged_copy_that_arrives_early_is_held_until_just_before_its_start(
        app: Celery) -> None:
    """Its pool sees it a start's length before its start (at least HANDOFF_S), not a
    process's sleep earlier; meanwhile
    the prefetch window is one larger (it holds no place there), and the time held travels
    in its header for the trip estimate."""
    task = _task(app)
    consumer = _consumer()
    arrivals = _Arrivals(task, consumer)
    message = _dispatched(app, task, 450_000)
    assert not arrivals.lined_up(message)
    early = arrivals.early_by(message)
    assert 0.25 < early <= 0.45 - HANDOFF_S
    handed: list[Message] = []
    arrivals.hold(message, early, lambda: handed.append(message))
    assert consumer.qos.raised == 1
    ((seconds, release, _),) = consumer.timer.calls
    assert seconds == early
    assert not handed
    release()
    assert handed == [message]
    assert consumer.qos.raised == 0
    held = cast(dict[str, Any], message.headers)[HEADER]["held"]
    assert isinstance(held, int)
    assert held >= 0


def test_only_a_charged_copy_ahead_of_its_start_is_held_and_never_beyond_the_most_ahead(
        app: Celery) -> None:
    """A copy whose start has come, an uncharged one (expired, revoked: it is dropped in the
    pool), a fresh message: handed on at once; a copy far ahead (a clock that jumped) is
    held at most MAX_AHEAD_US."""
    task = _task(app)
    arrivals = _Arrivals(task, _consumer())
    assert arrivals.early_by(_dispatched(app, task, -1_000)) == 0.0
    assert arrivals.early_by(_dispatched(app, task, 300_000, charged="x")) == 0.0
    assert arrivals.early_by(_received(app, task, 1)) == 0.0
    far = arrivals.early_by(_dispatched(app, task, 60_000_000))
    assert far == MAX_AHEAD_US / 1e6 - HANDOFF_S


@pytest.mark.parametrize(("spacing", "handoff"), [
    ((100_000,), 0.1),  # 10/s: one start's length ahead
    ((50_000, 0), 0.05),  # 20/s with a concurrency limit (no spacing)
    ((1_000,), HANDOFF_S),  # 1000/s: the floor
    ((1_000_000, 20_000), HANDOFF_MAX_S),  # 1/s: the cap
])
def test_a_held_copy_is_handed_on_one_start_s_length_before_its_start(
        app: Celery, spacing: tuple[int, ...], handoff: float) -> None:
    """A start's length ahead (its limits' longest interval, between the floor and the cap):
    room for a late timer and a pool process coming free, about one asleep per start."""
    task = _task(app)
    arrivals = _Arrivals(task, _consumer())
    far = arrivals.early_by(_dispatched(app, task, 60_000_000, spacing=spacing))
    assert far == pytest.approx(MAX_AHEAD_US / 1e6 - handoff)


def test_a_store_that_fails_hands_a_charged_copy_on_at_once(
        redis_url: str, prefix: str) -> None:
    """Without the store's clock the consumer does not hold it: its process sleeps the wait."""
    with installed_app("arrival-down", redis_url, prefix,
                       throttle_redis_url="redis://127.0.0.1:1/0") as down:
        task = _task(down)
        headers: dict[str, Any] = {HEADER: {"entry": "x:-", "charged": "c", START: 2**52}}
        message = _received(down, task, 1, headers=headers)
        assert _Arrivals(task, _consumer()).early_by(message) == 0.0


def test_a_line_found_empty_is_not_asked_again_for_a_moment(app: Celery) -> None:
    """Where nothing waits, the consumer does not pay a store call per message: a line found
    empty, its next start near, sends the limit's fresh messages to the pool for
    EMPTY_FOR_S (whose gate finds a line formed meanwhile) while the starts they take
    stay within reach; after that it looks again."""
    task = _task(app)
    arrivals = _Arrivals(task, _consumer())
    assert not arrivals.lined_up(_received(app, task, 1))
    until, _ = arrivals.empty[("arrive", "")]
    assert until > time.monotonic()
    arrivals.empty[("arrive", "")] = (time.monotonic() + 60, 0)  # (the moment, made long)
    _someone_in_line(app)
    assert not arrivals.lined_up(_received(app, task, 2))
    lines = runtime_for(app).room.lines
    assert len(lines.next_in_line(10, "arrive")) == 1
    arrivals.empty[("arrive", "")] = (0.0, 0)  # (the moment passed)
    assert arrivals.lined_up(_received(app, task, 3))
    assert len(lines.next_in_line(10, "arrive")) == 2
    assert ("arrive", "") not in arrivals.empty


def test_a_task_whose_start_is_out_of_reach_waits_in_an_empty_line_as_it_arrives(
        app: Celery) -> None:
    """The line empty but the limit's next start further than a pool process would sleep:
    the task lines up at once (no pool run only to put it in line), first in line, due at
    that start.  A message handed on to the pool counts as the start it will take: at
    1/s the next message is looked at again, not handed on blindly."""
    task = _task(app)
    arrivals = _Arrivals(task, _consumer())
    lines = runtime_for(app).room.lines
    assert not arrivals.lined_up(_received(app, task, 1))  # (the bucket is empty)
    _, projected = arrivals.empty[("arrive", "")]
    assert projected - arrivals._now_us(runtime_for(app)) > 900_000  # (its 1/s start)
    # The pool's gate admits the first; the second's start is a second away.
    gate = runtime_for(app).gate
    assert gate.acquire_many([Limit("arrive", parse_rate(RATE))]).allowed
    message = _received(app, task, 2)
    assert arrivals.lined_up(message)
    (waiting,) = lines.next_in_line(10, "arrive")
    assert waiting.entry == entry_id(message.headers["id"])
    assert ("arrive", "") not in arrivals.empty
