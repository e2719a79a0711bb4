"""Waiting tasks kept in a log on RabbitMQ (room/logged.py), on real servers: a store that keeps
nothing on disk, killed and restarted, and a RabbitMQ node."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.room.logged import IMPATIENT_S, LoggedKeeper
from celery_throttle.room.parking import WaitingRoom
from celery_throttle.room.streams import StreamLog

from ..servers import restart_empty

TIMEOUT_US = 60_000_000


@pytest.fixture
def prefix() -> str:
    return f"logged{secrets.token_hex(4)}"


@pytest.fixture
def connect(rabbitmq_url: str) -> Any:
    return lambda: Connection(rabbitmq_url, transport_options={"confirm_publish": True})


@pytest.fixture
def rooms(store: redis.Redis, connect: Any, prefix: str) -> Iterator[list[WaitingRoom]]:
    """Make rooms (a node's each) with a keeper of their own; the log is deleted after."""
    made: list[WaitingRoom] = []
    yield made
    for room in made:
        assert isinstance(room.keeper, LoggedKeeper)
        room.keeper.log.close()
    deleter = StreamLog(connect, prefix)
    deleter.delete()
    deleter.close()


def _room(rooms: list[WaitingRoom], store: redis.Redis, connect: Any, prefix: str,
          **options: Any) -> WaitingRoom:
    keeper = LoggedKeeper(store, connect, prefix, marker_ttl_ms=60_000, **options)
    room = WaitingRoom(store, prefix, keeper=keeper)
    rooms.append(room)
    return room


def _live(connect: Any, prefix: str) -> set[str]:
    reader = StreamLog(connect, prefix)
    try:
        return set(reader.read().live)
    finally:
        reader.close()


def test_a_kept_task_is_restored_once_after_the_store_comes_back_empty(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """Two tasks in line and one parked, kept in the log: the store is killed; after it
    restarts the first dispatcher to look puts the two back in their line, in their order,
    and parks the third, due now; later looks do nothing."""
    room = _room(rooms, store, connect, prefix)
    limit = Limit("kept", parse_rate("1/h"))
    for i in range(2):
        assert room.enqueue(f"q{i}", b"line %d" % i, f"t{i}", limits=[limit], blocking=limit,
                            place_us=i, due_us=1, kept=True) > 0
    assert room.park("p", b"parked", "tp", delay_us=3_600_000_000, kept=True) > 0
    room.park("alone", b"not kept", "ta", delay_us=3_600_000_000)  # (the store was durable)
    assert _live(connect, prefix) == {"q0", "q1", "p"}
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 3  # (never restored for: all are handed)
    assert room.restore_kept(room.last_epoch) is None  # the same epoch: nothing to do
    restart_empty(store)
    assert store.hlen(f"{{{prefix}}}:room:messages") == 0
    assert room.take_due(10, TIMEOUT_US)[1] == []
    other = _room(rooms, store, connect, prefix)  # another node's dispatcher may notice
    assert other.restore_kept(room.last_epoch) == 3
    assert room.restore_kept(room.last_epoch) is None
    _, due = room.take_due(10, TIMEOUT_US)
    assert [(p.entry, p.message) for p in due] == [("p", b"parked")]
    assert [(t.entry, t.limit, t.message) for t in room.lines.next_in_line(10)] == [
        ("q0", "kept", b"line 0"), ("q1", "kept", b"line 1")]
    _, served = room.lines.serve_due(10, TIMEOUT_US)
    assert [s.entry for s in served] == ["q0"]
    # Each arrival takes its task out of the log.
    assert room.arrive("p", due[0].token, due[0].epoch, kept=True) > 0
    assert room.arrive("q0", served[0].token, served[0].epoch, kept=True) > 0
    assert _live(connect, prefix) == {"q1"}


def test_a_copy_from_before_the_loss_waits_for_the_restore_and_goes_on_once(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """A copy dispatched before the store restarted arrives before any node restored: it
    waits for the restore, then takes its entry back out of its line and goes on; the
    copy the restore's dispatch sends is refused, and a later loss restores nothing."""
    room = _room(rooms, store, connect, prefix)
    room.park("e", b"m", "t", at_us=1, kept=True)
    _, (before,) = room.take_due(10, TIMEOUT_US)
    restart_empty(store)
    answers: list[int] = []
    arriving = threading.Thread(target=lambda: answers.append(
        room.arrive("e", before.token, before.epoch, kept=True)))
    arriving.start()
    time.sleep(0.5)  # (it must still be waiting: asserted below)
    assert answers == []
    room.take_due(10, TIMEOUT_US)  # (a new epoch)
    assert room.restore_kept(room.last_epoch) == 1
    arriving.join(10)
    assert len(answers) == 1
    assert answers[0] > 0
    _, after = room.take_due(10, TIMEOUT_US)
    assert after == []  # its entry was taken back out of its line
    assert _live(connect, prefix) == set()
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 0


def test_a_task_taken_before_the_loss_is_not_restored_and_only_its_copy_goes_on(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """A copy went on before the store was lost: the restore leaves its task out, and marks
    it taken by that copy, whose acks_late redelivery goes on again; a second copy of the
    same dispatch entry (its dispatcher died after publishing) is refused."""
    room = _room(rooms, store, connect, prefix)
    room.park("e", b"m", "t", at_us=1, kept=True)
    _, (first,) = room.take_due(10, TIMEOUT_US)
    assert room.arrive("e", first.token, first.epoch, kept=True) > 0
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 0
    assert room.arrive("e", first.token, first.epoch, kept=True) > 0  # its redelivery
    assert room.arrive("e", "9.9", first.epoch, kept=True) == 0  # another copy


def test_a_write_the_store_refuses_leaves_nothing_to_restore(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """Lined up behind an empty line (nothing written), or the store down: the log says the
    task does not wait, or a later restore would bring it back as a second run.  A message
    delivered again while it waits keeps its first put."""
    room = _room(rooms, store, connect, prefix)
    limit = Limit("kept", parse_rate("1/h"))
    assert room.line_up("e", b"m", "t", limits=[limit], blocking=limit, place_us=1,
                        within_us=500_000, kept=True).ahead == -1
    store.server.kill()  # type: ignore[attr-defined]
    with pytest.raises(redis.ConnectionError):
        room.park("p", b"m", "t", delay_us=1, kept=True)
    assert _live(connect, prefix) == set()
    store.server.start()  # type: ignore[attr-defined]
    store.connection_pool.disconnect()
    assert room.park("p", b"first", "t", delay_us=1_000_000, kept=True) > 0
    assert room.park("p", b"again", "t", delay_us=1_000_000, kept=True) == 0
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 1
    _, due = room.take_due(10, TIMEOUT_US)
    assert [(p.entry, p.message) for p in due] == [("p", b"first")]


def test_a_compaction_keeps_every_waiting_task_and_runs_on_one_node_at_a_time(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """Two nodes see a compaction due: one compacts; the log then holds the waiting tasks
    only, in a new generation, and a restore after it brings back each of them."""
    one = _room(rooms, store, connect, prefix, switch_s=0.0)
    two = _room(rooms, store, connect, prefix, switch_s=0.0)
    one.park("p0", b"m0", "t0", at_us=1, kept=True)
    for i in (1, 2):
        one.park(f"p{i}", b"m%d" % i, f"t{i}", delay_us=3_600_000_000, kept=True)
    _, due = one.take_due(10, TIMEOUT_US)
    assert [p.entry for p in due] == ["p0"]
    assert one.arrive(due[0].entry, due[0].token, due[0].epoch, kept=True) > 0
    for room in (one, two):
        assert isinstance(room.keeper, LoggedKeeper)
        room.keeper.maintain()
    keepers = [r.keeper for r in (one, two) if isinstance(r.keeper, LoggedKeeper)]
    assert all(k.compacted(30) for k in keepers)
    reader = StreamLog(connect, prefix)
    try:
        assert reader.generations() == [2]  # (two compactions would have made 3)
        assert set(reader.read().live) == {"p1", "p2"}
    finally:
        reader.close()
    assert store.get(f"{{{prefix}}}:room:ledger:gen") == b"2"
    restart_empty(store)
    one.take_due(10, TIMEOUT_US)
    assert one.restore_kept(one.last_epoch) == 2


def test_purge_deletes_the_log(
    store: redis.Redis, connect: Any, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """A purged task is not brought back by a later restore; the log starts again."""
    room = _room(rooms, store, connect, prefix)
    room.park("p", b"m", "t", delay_us=1_000_000, kept=True)
    room.purge()
    room.park("q", b"m", "t2", delay_us=1_000_000, kept=True)
    assert _live(connect, prefix) == {"q"}


def test_a_log_that_cannot_be_written_fails_the_write_as_the_store_would(
    store: redis.Redis, prefix: str
) -> None:
    """The broker unreachable longer than an append tries: the wait fails as a failed store
    write (a ``redis.ConnectionError``: its caller sends the task back as a countdown),
    and nothing waits in the store without its record."""
    dead = lambda: Connection("amqp://guest:guest@127.0.0.1:1//",  # noqa: E731
                              connect_timeout=0.2)
    room = WaitingRoom(store, prefix, keeper=LoggedKeeper(store, dead, prefix,
                                                          marker_ttl_ms=60_000, retry_s=0.5))
    with pytest.raises(redis.ConnectionError, match="the waiting tasks' log on the broker"):
        room.park("p", b"m", "t", delay_us=1_000_000, kept=True)
    assert store.hlen(f"{{{prefix}}}:room:messages") == 0


def test_the_worker_s_main_process_does_not_wait_for_an_unreachable_log(
    store: redis.Redis, prefix: str
) -> None:
    """A task lined up on arrival is written by the thread that also consumes the broker's
    messages and runs the worker's shutdown: with the broker gone, its put gives up after
    ``IMPATIENT_S`` (the pool then gates the task) where a pool process's tries for
    ``retry_s``; a copy arriving there before the restore fails at once rather than
    waiting for it."""
    dead = lambda: Connection("amqp://guest:guest@127.0.0.1:1//",  # noqa: E731
                              connect_timeout=0.2)
    keeper = LoggedKeeper(store, dead, prefix, marker_ttl_ms=60_000, retry_s=30.0)
    room = WaitingRoom(store, prefix, keeper=keeper)
    limit = Limit("kept", parse_rate("1/h"))
    began = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="the waiting tasks' log on the broker"):
        room.enqueue("q", b"m", "t", limits=[limit], blocking=limit, place_us=1, kept=True,
                     patient=False)
    took = time.monotonic() - began
    assert took < IMPATIENT_S + 5.0 < keeper.log.retry_s, took  # (not the 30 s of retry_s)
    assert store.hlen(f"{{{prefix}}}:room:messages") == 0
    restart_empty(store)
    store.set(f"{{{prefix}}}:epoch", 1)  # (the store's new epoch: never restored for)
    with pytest.raises(redis.ConnectionError, match="not restored yet"):
        keeper.take("q", "token", epoch=0, patient=False)


def test_a_drop_the_main_process_cannot_write_now_is_written_later(
    store: redis.Redis, rabbitmq_url: str, prefix: str, rooms: list[WaitingRoom]
) -> None:
    """A task's arrival finds its line empty, so its put is dropped again; the broker cannot
    take the drop within ``IMPATIENT_S``: the arrival goes on (the pool gates the task), and
    the drop is written once the broker is back, so no restore brings the task back."""
    up = {"broker": False}

    def connect() -> Connection:
        url = rabbitmq_url if up["broker"] else "amqp://guest:guest@127.0.0.1:1//"
        return Connection(url, transport_options={"confirm_publish": True},
                          connect_timeout=0.2)

    up["broker"] = True
    room = _room(rooms, store, connect, prefix)
    limit = Limit("kept", parse_rate("1/h"))
    assert room.keeper is not None
    put = room.keeper.put  # the put lands; then the broker goes away before the drop

    def put_then_lose_the_broker(entry: str, value: bytes, *, patient: bool = True) -> Any:
        mark = put(entry, value, patient=patient)
        up["broker"] = False
        assert isinstance(room.keeper, LoggedKeeper)
        room.keeper.log.close()
        return mark

    room.keeper.put = put_then_lose_the_broker  # type: ignore[method-assign]
    # The line is empty: nothing is written to the store (-1), and the put is dropped.
    assert room.line_up("q", b"m", "t", limits=[limit], blocking=limit, place_us=1,
                        within_us=500_000, kept=True, patient=False).ahead == -1
    up["broker"] = True
    assert _live(connect, prefix) in ({"q"}, set())  # (the drop may have landed already)
    deadline = time.monotonic() + 20
    while _live(connect, prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live(connect, prefix) == set()
