"""The waiting room's scripts on a real Redis: park, claim due entries, first arrival wins."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

from celery_throttle.core.keys import epoch_key, key_digest
from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.room.entries import entry_id
from celery_throttle.room.parking import Parked, WaitingRoom

from .. import databases

# Far enough ahead that nothing becomes due while a test runs.
LATER_US = 3_600 * 1_000_000


def _now_us(client: redis.Redis | RedisCluster) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def test_entry_is_dispatched_only_once_it_is_due(client: redis.Redis, prefix: str) -> None:
    """An entry parked for later is not claimed; one parked for now is, once, with its message."""
    room = WaitingRoom(client, prefix)
    room.park("later", b"L", "t1", delay_us=LATER_US)
    room.park("now", b"N", "t2", at_us=_now_us(client) - 1)
    wait, claimed = room.take_due(10, 60_000_000)
    assert [(p.entry, p.message) for p in claimed] == [("now", b"N")]
    assert wait is not None
    assert 3_590 < wait <= 3_600
    assert room.take_due(10, 60_000_000)[1] == []


def test_two_dispatchers_never_claim_the_same_entry(client: redis.Redis, prefix: str) -> None:
    """Four threads claiming 400 due entries in batches of 7 get each exactly once."""
    room = WaitingRoom(client, prefix)
    at = _now_us(client) - 1
    for i in range(400):
        room.park(f"e{i}", b"m", f"t{i}", at_us=at)
    got: list[list[str]] = [[] for _ in range(4)]

    def drain(n: int) -> None:
        own = WaitingRoom(redis.Redis(connection_pool=client.connection_pool), prefix)
        for _ in range(200):  # bounded: 400 entries / 7 per batch needs 58 calls at most
            _, batch = own.take_due(7, 60_000_000)
            if not batch:
                return
            got[n] += [p.entry for p in batch]

    threads = [threading.Thread(target=drain, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    every = [e for part in got for e in part]
    assert sorted(every) == sorted(f"e{i}" for i in range(400))


def test_a_claim_not_arrived_by_its_deadline_is_dispatched_again(
    client: redis.Redis, prefix: str
) -> None:
    """A dispatcher that dies after claiming loses nothing: the entry is due again, new token."""
    room = WaitingRoom(client, prefix)
    room.park("e", b"m", "t", at_us=_now_us(client) - 1)
    _, first = room.take_due(10, 1)  # a deadline 1 us away: past by the next call
    _, again = room.take_due(10, 60_000_000)
    assert [p.entry for p in first] == [p.entry for p in again] == ["e"]
    assert first[0].token != again[0].token


def _dispatched_twice(client: redis.Redis, prefix: str) -> tuple[WaitingRoom, Parked, Parked]:
    """One entry dispatched, its claim timed out (deadline 1 us), dispatched again."""
    room = WaitingRoom(client, prefix)
    room.park("e", b"m", "t", at_us=_now_us(client) - 1)
    _, (first,) = room.take_due(10, 1)
    _, (second,) = room.take_due(10, 60_000_000)
    return room, first, second


def test_first_copy_to_arrive_goes_on_and_a_second_is_refused(
    client: redis.Redis, prefix: str
) -> None:
    """Two published copies of one entry (a re-dispatch): exactly one goes on."""
    room, first, second = _dispatched_twice(client, prefix)
    assert room.arrive("e", second.token, second.epoch) > 0
    assert room.arrive("e", first.token, first.epoch) == 0
    # Its claim is settled: nothing is dispatched a third time.
    assert room.take_due(10, 60_000_000)[1] == []
    assert room.state().dispatching == 0


def test_acks_late_redelivery_of_the_copy_that_went_on_goes_on_again(
    client: redis.Redis, prefix: str
) -> None:
    """With a marker, the same dispatch's copy (the broker's redelivery) may go on again."""
    room, first, second = _dispatched_twice(client, prefix)
    assert room.arrive("e", first.token, first.epoch, marker_ttl_ms=60_000) > 0
    assert room.arrive("e", first.token, first.epoch, marker_ttl_ms=60_000) > 0
    assert room.arrive("e", second.token, second.epoch, marker_ttl_ms=60_000) == 0


def test_a_store_that_lost_its_data_lets_a_dispatched_copy_go_on(
    client: redis.Redis, prefix: str
) -> None:
    """After a flush (new epoch) a copy already dispatched runs rather than being lost."""
    room = WaitingRoom(client, prefix)
    room.park("e", b"m", "t", at_us=_now_us(client) - 1)
    _, (item,) = room.take_due(10, 60_000_000)
    client.delete(room.messages, room.claimed, epoch_key(prefix))  # what a restart leaves
    client.set(epoch_key(prefix), "1")
    assert room.arrive("e", item.token, item.epoch) > 0


def test_only_a_new_earliest_entry_wakes_a_dispatcher(client: redis.Redis, prefix: str) -> None:
    """The wake token is pushed when an entry becomes the earliest, and at most one is kept."""
    room = WaitingRoom(client, prefix)
    room.park("a", b"m", "t", delay_us=LATER_US)
    room.park("b", b"m", "t", delay_us=LATER_US // 2)
    assert client.llen(room.wake) == 1  # both were the earliest when parked; one token kept
    assert room.sleep(0.01) is True
    room.park("c", b"m", "t", delay_us=LATER_US)
    assert room.sleep(0.01) is False


def test_the_wait_note_is_kept_while_parked_and_a_minute_after_the_arrival(
    client: redis.Redis, prefix: str
) -> None:
    """The note for `why` is written by the park, read while parked, and moved by the
    arrival to a key of its own with a TTL (no key per waiting task: memory)."""
    from celery_throttle.core.keys import task_key

    room = WaitingRoom(client, prefix)
    room.park("e", b"m", "task-1", at_us=_now_us(client) - 1, note='{"limit": "x"}')
    key = task_key(prefix, "wait", "task-1")
    assert client.exists(key) == 0
    assert room.read_note("task-1")[1] == b'{"limit": "x"}'
    assert room.next_parked(1)[0].note is None  # (its message b"m" names no task id)
    _, [item] = room.take_due(10, 60_000_000)
    assert room.arrive("e", item.token, item.epoch, task_id="task-1", note_ttl_ms=60_000) > 0
    assert client.get(key) == b'{"limit": "x"}'
    assert 59_000 < client.pttl(key) <= 60_000
    assert client.hlen(room.notes) == 0
    assert room.read_note("task-1")[1] == b'{"limit": "x"}'


def test_a_task_in_line_notes_its_entry_and_the_arrival_drops_it(
    client: redis.Redis, prefix: str
) -> None:
    """A task in line is noted by its entry: the user's own message by none (found from
    its task id), a copy in line again by a pointer.  Dispatched, its record becomes its
    plain message; its arrival deletes the pointer and keeps no key (the entry it pointed
    at is gone: nothing to say after the start)."""
    from celery_throttle.core.keys import task_key

    room = WaitingRoom(client, prefix)
    limit = Limit("ptr", parse_rate("100/s"), burst=2)  # (both due at once)
    own = entry_id("task-0")
    for entry, task_id in ((own, "task-0"), ("e", "task-1")):
        room.enqueue(entry, b"\x01m", task_id, limits=[limit], blocking=limit,
                     place_us=_now_us(client))
    assert client.hkeys(room.notes) == [key_digest("task-1").encode()]
    assert room.read_note("task-0")[1] == b"@" + own.encode()
    assert room.read_note("task-1")[1] == b"@e"
    _, served = room.lines.serve_due(10, 60_000_000)
    assert [s.entry for s in served] == [own, "e"]
    assert [s.message for s in served] == [b"\x01m"] * 2
    assert client.hmget(room.messages, [own, "e"]) == [b"\x01m"] * 2  # claimed as parked
    assert room.read_note("task-0")[1] == b""  # dispatched: no longer in line
    for item, task_id in zip(served, ("task-0", "task-1"), strict=True):
        assert room.arrive(item.entry, item.token, item.epoch, task_id=task_id,
                           note_ttl_ms=60_000) > 0
    assert client.hlen(room.notes) == 0
    assert client.exists(task_key(prefix, "wait", "task-1")) == 0
    assert room.read_note("task-1")[1] == b""


def test_state_counts_parked_and_dispatching(client: redis.Redis, prefix: str) -> None:
    """state(): parked and claimed counts and seconds to the next dispatch."""
    room = WaitingRoom(client, prefix)
    assert room.state().next_dispatch is None
    room.park("a", b"m", "t", at_us=_now_us(client) - 1)
    room.park("b", b"m", "t", delay_us=LATER_US)
    room.take_due(10, 60_000_000)
    state = room.state()
    assert (state.parked, state.dispatching) == (1, 1)
    assert state.next_dispatch is not None
    assert 3_590 < state.next_dispatch <= 3_600


def test_scripts_reload_after_script_flush(client: redis.Redis, prefix: str) -> None:
    """NOSCRIPT after SCRIPT FLUSH is recovered by redis-py's Script (no cache of our own)."""
    room = WaitingRoom(client, prefix)
    room.park("a", b"m", "t", at_us=_now_us(client) - 1)
    client.script_flush()
    assert [p.entry for p in room.take_due(10, 60_000_000)[1]] == ["a"]
    client.script_flush()
    assert room.arrive("a", "x", 0) > 0


def test_prometheus_collector_reports_parked_and_dispatching(redis_url: str, prefix: str) -> None:
    """The scrape-time collector reads the waiting room's counts from Redis."""
    from celery import Celery

    from celery_throttle.integration.exporter import FillCollector
    from celery_throttle.integration.runtime import runtime_for

    app = Celery("room-metrics", set_as_current=False)
    app.conf.update(throttle_redis_url=redis_url, throttle_prefix=prefix)
    room = runtime_for(app).room
    now = _now_us(room.client)
    room.park("a", b"m", "t1", at_us=now - 1)
    room.park("b", b"m", "t2", delay_us=LATER_US)
    room.park("c", b"m", "t3", delay_us=LATER_US)
    room.take_due(10, 60_000_000)
    values = {m.name: m.samples[0].value for m in FillCollector(app).collect()
              if m.name in ("celery_throttle_parked", "celery_throttle_dispatching")}
    app.close()
    assert values == {"celery_throttle_parked": 2, "celery_throttle_dispatching": 1}


def test_release_with_nothing_in_line_frees_the_seat(client: redis.Redis,
                                                     prefix: str) -> None:
    """No task in the seat's line: the seat is simply free for the next caller."""
    from celery_throttle import Concurrency, Gate

    gate = Gate(client, prefix=prefix)
    lim = Concurrency("free", 1, lease=30)
    assert gate.acquire_many([lim], holder="a").allowed
    assert gate.release([lim], "a") == 1
    assert gate.acquire_many([lim], holder="b").allowed


def test_dispatches_run_ahead_by_the_measured_trip(client: redis.Redis, prefix: str) -> None:
    """Arrivals measure dispatch -> arrival; later dispatches go out that much ahead of time."""
    room = WaitingRoom(client, prefix)
    room.park("first", b"m", "t1", delay_us=LATER_US)
    dispatched_ago = f"{_now_us(client) - 400_000}.1"  # the token carries the dispatch time
    assert room.arrive("first", dispatched_ago, 0) > 0
    assert client.hget(room.trip, "avg") is not None
    room.park("in-0.3s", b"m", "t2", delay_us=300_000)
    room.park("in-9s", b"m", "t3", delay_us=9_000_000)
    wait, dispatched = room.take_due(10, 60_000_000)
    assert [p.entry for p in dispatched] == ["in-0.3s"]  # within the 0.4 s trip
    assert wait is not None
    assert 8.5 < wait <= 8.6  # the next goes out 0.4 s before its time too


def test_a_trip_longer_than_any_dispatch_ahead_is_not_counted(
        client: redis.Redis, prefix: str) -> None:
    """A copy that took longer than the most a task is dispatched ahead waited in a queue
    (a lane backed up, a copy restored after its node died): the estimate keeps its
    value, so the copies after it are not dispatched further ahead."""
    from celery_throttle.room.lines import MAX_AHEAD_US

    room = WaitingRoom(client, prefix)
    for entry, ago in (("quick", 20_000), ("queued", MAX_AHEAD_US + 1_000_000)):
        room.park(entry, b"m", entry, delay_us=LATER_US)
        assert room.arrive(entry, f"{_now_us(client) - ago}.1", 0) > 0
    avg = int(client.hget(room.trip, "avg") or 0)
    assert 20_000 <= avg < 25_000  # the queued copy's 1.5 s left no trace


def test_prometheus_collector_reports_each_limits_line(redis_url: str, prefix: str) -> None:
    """The scrape-time collector reads each limit's tasks in line and their drain estimate,
    at the rate in force (a live override included)."""
    from celery import Celery

    from celery_throttle import Limit, parse_rate
    from celery_throttle.integration.exporter import FillCollector
    from celery_throttle.integration.runtime import runtime_for

    app = Celery("line-metrics", set_as_current=False)
    app.conf.update(throttle_redis_url=redis_url, throttle_prefix=prefix,
                    throttle_queues={"slow": "1/s"})
    runtime = runtime_for(app)
    limit = Limit("queue:slow", parse_rate("1/s"))
    now = _now_us(runtime.room.client)
    for i in range(4):
        runtime.room.lines.enqueue(f"e{i}", b"m", f"t{i}", limits=[limit], blocking=limit,
                                    place_us=now + i)
    runtime.live.set("queue:slow", "2/s")
    runtime.live.refresh = 0.0
    values = {(m.name, s.labels.get("limit")): s.value for m in FillCollector(app).collect()
              for s in m.samples if m.name.startswith(("celery_throttle_in_line",
                                                       "celery_throttle_drain"))}
    app.close()
    assert values == {("celery_throttle_in_line", "queue:slow"): 4,
                      ("celery_throttle_drain_seconds", "queue:slow"): 2.0}


def test_an_idle_dispatcher_stops_at_once_and_leaves_no_key(redis_url: str, client: redis.Redis,
                                                            prefix: str) -> None:
    """A node's warm shutdown does not wait out the dispatcher's blocking pop (IDLE seconds):
    stop() wakes it through a list of its own, which is gone afterwards."""
    from celery import Celery

    from celery_throttle.room.dispatcher import IDLE, Dispatcher

    app = Celery("idle", broker="memory://", set_as_current=False)
    dispatcher = Dispatcher(app, lambda **o: redis.Redis.from_url(redis_url, **o), prefix,
                            timeout=60)
    dispatcher.start()
    deadline = time.monotonic() + 5
    # Asleep: its connection is blocked in BLPOP (CLIENT LIST names the command).
    def asleep() -> bool:
        return any(c.get("cmd") == "blpop" for c in client.client_list())

    while time.monotonic() < deadline and not asleep():
        time.sleep(0.02)
    assert asleep()
    began = time.monotonic()
    dispatcher.stop()
    took = time.monotonic() - began
    assert not dispatcher._thread.is_alive()
    assert took < IDLE / 5, f"stop took {took:.2f}s"
    assert client.keys(f"{{{prefix}}}:room:bell:*") == []
    app.close()


def _down(redis_url: str, prefix: str, broker: str) -> tuple[Any, Any, bytes]:
    """An app whose broker refuses connections (publishes not tried again), its dispatcher,
    and a message to park for it."""
    from celery import Celery

    from celery_throttle.room.dispatcher import Dispatcher
    from celery_throttle.room.envelope import Envelope

    app = Celery("down", broker=broker, set_as_current=False)
    app.conf.task_publish_retry_policy = {"max_retries": 0}
    app.conf.broker_connection_timeout = 1
    dispatcher = Dispatcher(app, lambda **o: redis.Redis.from_url(redis_url, **o), prefix,
                            timeout=60)
    return app, dispatcher, Envelope(b"[]", "application/json", "utf-8", "", "celery",
                                     {}).dumps()


def test_a_publish_the_broker_refuses_is_due_again_at_the_next_try(
    redis_url: str, client: redis.Redis, prefix: str
) -> None:
    """The broker down: the claimed entry is not held for the dispatch timeout (a minute)
    after it is back, but claimed again at the dispatcher's next try, with a new token."""
    from kombu.exceptions import OperationalError

    from celery_throttle.testing import free_port

    app, dispatcher, message = _down(redis_url, prefix, f"redis://127.0.0.1:{free_port()}/0")
    room = WaitingRoom(client, prefix)
    room.park("e", message, "t", at_us=_now_us(client) - 1)
    room.park("f", message, "t2", at_us=_now_us(client) - 1)
    with pytest.raises(OperationalError):
        dispatcher._publish(room.take_due(10, 60_000_000)[1])
    _, again = room.take_due(10, 60_000_000)
    assert sorted(p.entry for p in again) == ["e", "f"]
    assert dispatcher.dispatched == 0
    if dispatcher._connection is not None:
        dispatcher._connection.release()
    dispatcher.client.close()
    app.close()


def test_a_broker_outage_is_logged_as_a_warning_not_an_error(
    redis_url: str, client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The dispatcher meets a broker that refuses connections: it says so once as a WARNING
    (it tries again, and the outage ends on its own), never as an ERROR."""
    from celery_throttle.testing import free_port

    app, dispatcher, message = _down(redis_url, prefix,
                                     f"amqp://guest:guest@127.0.0.1:{free_port()}//")
    WaitingRoom(client, prefix).park("e", message, "t", at_us=_now_us(client) - 1)

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "throttle: dispatcher:" in r.getMessage()]

    with caplog.at_level(logging.WARNING):
        dispatcher.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not said():
                time.sleep(0.05)
        finally:
            dispatcher.stop()
    assert said(), "the outage was not logged"
    assert {r.levelname for r in said()} == {"WARNING"}, [r.getMessage() for r in said()]
    assert dispatcher.dispatched == 0
    app.close()


def test_a_backed_up_lane_holds_the_lines(redis_url: str, prefix: str) -> None:
    """Copies wait in a lane that no worker fetches: the dispatcher serves no line (each
    copy served would reach its worker after its start) until the lane is read again."""
    from celery import Celery
    from kombu import Connection

    from celery_throttle.room.dispatcher import LANE_SLACK, Dispatcher
    from celery_throttle.testing import server_url

    broker = f"{server_url(redis_url)}/{databases.SCRATCH}"
    app = Celery("lanes", broker=broker, set_as_current=False)
    dispatcher = Dispatcher(app, lambda **o: redis.Redis.from_url(redis_url, **o), prefix,
                            timeout=60)
    lane = f"{prefix}.dispatched"
    dispatcher._lanes.add(lane)
    with Connection(broker) as conn:
        queue = conn.SimpleQueue(lane)
        try:
            assert not dispatcher._backed_up()  # (no such list yet)
            for i in range(LANE_SLACK + 1):
                queue.put({"i": i})
            assert dispatcher._backed_up()
            assert dispatcher.dispatch_due() == pytest.approx(0.05)  # looks again soon
            queue.get(timeout=1).ack()
            assert not dispatcher._backed_up()
        finally:
            queue.clear()
            queue.close()
    if dispatcher._connection is not None:
        dispatcher._connection.release()
    dispatcher.client.close()
    app.close()


def test_the_time_a_consumer_held_a_copy_is_left_out_of_the_trip(
    client: redis.Redis, prefix: str
) -> None:
    """The trip estimate measures dispatch to arrival less what the worker's consumer held
    the copy for (it held it on purpose, until just before its start)."""
    room = WaitingRoom(client, prefix)
    room.park("e", b"m", "t", at_us=_now_us(client) - 1)
    _, (copy,) = room.take_due(10, 60_000_000)
    dispatched = int(copy.token.split(".")[0])
    deadline = time.monotonic() + 5
    while _now_us(client) < dispatched + 30_000 and time.monotonic() < deadline:
        time.sleep(0.005)
    before = _now_us(client)
    assert room.arrive("e", copy.token, copy.epoch, held_us=20_000) > 0
    after = _now_us(client)
    avg = int(client.hget(room.trip, "avg") or -1)
    assert before - dispatched - 20_000 <= avg <= after - dispatched - 20_000
