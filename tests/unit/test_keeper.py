"""Waiting tasks kept beside the broker's queues (room/keeper.py), on two real servers: a
store that keeps nothing on disk, killed and restarted, and the broker's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.integration.config import read_config
from celery_throttle.integration.runtime import durability_of, keeper_of
from celery_throttle.room.keeper import Keeper
from celery_throttle.room.parking import RESTORING_ELSEWHERE, WaitingRoom

from ..servers import restart_empty

TIMEOUT_US = 60_000_000
PREFIX = "kept"


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    from celery_throttle.testing import RedisServer

    with RedisServer() as server:
        client = redis.Redis.from_url(f"{server.url}/0")
        yield client
        client.close()


def _room(store: redis.Redis, broker: redis.Redis) -> WaitingRoom:
    return WaitingRoom(store, PREFIX, keeper=Keeper(broker, PREFIX, marker_ttl_ms=60_000))


def _kept(room: WaitingRoom) -> int:
    """How many copies the room's keeper holds."""
    assert room.keeper is not None
    found = room.keeper.count()
    assert found is not None
    return found


def test_a_kept_task_is_restored_once_after_the_store_comes_back_empty(
    store: redis.Redis, broker: redis.Redis
) -> None:
    """Two tasks in line and one parked, kept: the store is killed; after it restarts the
    first dispatcher to look puts the two back in their line, in their order, and parks
    the third, due now; later looks do nothing."""
    room = _room(store, broker)
    limit = Limit("kept", parse_rate("1/h"))
    for i in range(2):
        assert room.enqueue(f"q{i}", b"line %d" % i, f"t{i}", limits=[limit], blocking=limit,
                            place_us=i, due_us=1, kept=True) > 0
    assert room.park("p", b"parked", "tp", delay_us=3_600_000_000, kept=True) > 0
    room.park("alone", b"not kept", "ta", delay_us=3_600_000_000)  # (the store was durable)
    assert _kept(room) == 3
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 3  # (never restored for: all are handed)
    assert room.restore_kept(room.last_epoch) is None  # the same epoch: nothing to do
    restart_empty(store)
    assert store.hlen(f"{{{PREFIX}}}:room:messages") == 0
    assert room.take_due(10, TIMEOUT_US)[1] == []
    other = _room(store, broker)  # another node's dispatcher may be the one to notice
    assert other.restore_kept(room.last_epoch) == 3
    assert room.restore_kept(room.last_epoch) is None
    _, due = room.take_due(10, TIMEOUT_US)
    assert [(p.entry, p.message) for p in due] == [("p", b"parked")]
    assert [(t.entry, t.limit, t.message) for t in room.lines.next_in_line(10)] == [
        ("q0", "kept", b"line 0"), ("q1", "kept", b"line 1")]
    # Served from its line as before the loss: the first now (the bucket starts full).
    _, served = room.lines.serve_due(10, TIMEOUT_US)
    assert [s.entry for s in served] == ["q0"]
    # The task without a kept copy is gone with the store: it was never kept.
    assert _kept(room) == 3  # until each arrives


def test_one_node_restores_at_a_time_and_a_dead_one_leaves_it_to_the_next(
    store: redis.Redis, broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes see the store come back empty at once: one restores; the other is told a
    node is at it (its dispatcher asks again later) and then finds nothing to do.  A node
    that died restoring holds the others off only until its lock's time is up."""
    first, second = _room(store, broker), _room(store, broker)
    for i in range(3):
        first.park(f"p{i}", b"m", f"t{i}", delay_us=3_600_000_000, kept=True)
    restart_empty(store)
    first.take_due(10, TIMEOUT_US)  # (reads the store's new epoch)
    epoch = first.last_epoch
    assert first.keeper is not None
    restore, began, go_on = first.keeper.restore, threading.Event(), threading.Event()

    def slow_restore(*args: Any) -> int:
        began.set()
        go_on.wait(10)
        return restore(*args)

    monkeypatch.setattr(first.keeper, "restore", slow_restore)
    handed: list[int | None] = []
    restoring = threading.Thread(target=lambda: handed.append(first.restore_kept(epoch)))
    restoring.start()
    assert began.wait(10)
    assert second.restore_kept(epoch) == RESTORING_ELSEWHERE
    go_on.set()
    restoring.join(10)
    assert handed == [3]
    assert second.restore_kept(epoch) is None
    assert store.zcard(f"{{{PREFIX}}}:room:parked") == 3
    # A node died holding the restore of the next loss: the others wait for its lock only.
    restart_empty(store)
    first.take_due(10, TIMEOUT_US)
    store.set(f"{{{PREFIX}}}:room:restoring", "dead", px=300)
    assert second.restore_kept(first.last_epoch) == RESTORING_ELSEWHERE
    deadline = time.monotonic() + 10
    found = second.restore_kept(first.last_epoch)
    while found == RESTORING_ELSEWHERE and time.monotonic() < deadline:
        time.sleep(0.05)
        found = second.restore_kept(first.last_epoch)
    assert found == 3


def test_the_first_copy_to_arrive_takes_the_kept_copy_whatever_the_store_lost(
    store: redis.Redis, broker: redis.Redis
) -> None:
    """A copy dispatched before the store restarted and the copy the restore dispatched
    after it: whichever arrives first goes on, the other is refused; an acks_late
    redelivery of the first goes on again."""
    room = _room(store, broker)
    room.park("e", b"m", "t", at_us=1, kept=True)
    _, (before,) = room.take_due(10, TIMEOUT_US)
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 1
    _, (after,) = room.take_due(10, TIMEOUT_US)
    assert after.token != before.token
    assert room.arrive("e", after.token, after.epoch, marker_ttl_ms=60_000, kept=True) > 0
    assert room.arrive("e", before.token, before.epoch, kept=True) == 0  # refused
    assert room.arrive("e", after.token, after.epoch, marker_ttl_ms=60_000, kept=True) > 0
    assert _kept(room) == 0
    # The other order: the copy from before the restart arrives first, and is the one.
    room.park("f", b"m", "t2", at_us=1, kept=True)
    _, (first,) = room.take_due(10, TIMEOUT_US)
    restart_empty(store)
    assert room.arrive("f", first.token, first.epoch, kept=True) > 0  # (before the restore)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 0  # taken already: nothing to restore
    assert room.take_due(10, TIMEOUT_US)[1] == []


def test_a_write_the_store_refuses_leaves_no_kept_copy(
    store: redis.Redis, broker: redis.Redis
) -> None:
    """Lined up on arrival behind an empty line (nothing written), or the store down: no
    kept copy is left, which a later restore would bring back as a second run."""
    room = _room(store, broker)
    limit = Limit("kept", parse_rate("1/h"))
    assert room.line_up("e", b"m", "t", limits=[limit], blocking=limit, place_us=1,
                        within_us=500_000, kept=True).ahead == -1
    assert _kept(room) == 0
    store.server.kill()  # type: ignore[attr-defined]
    with pytest.raises(redis.ConnectionError):
        room.park("p", b"m", "t", delay_us=1, kept=True)
    assert _kept(room) == 0
    # A message delivered again while it waits keeps its one kept copy.
    store.server.start()  # type: ignore[attr-defined]
    store.connection_pool.disconnect()
    assert room.park("p", b"m", "t", delay_us=1_000_000, kept=True) > 0
    assert room.park("p", b"m", "t", delay_us=1_000_000, kept=True) == 0
    assert _kept(room) == 1


def test_a_copy_delivered_again_leaves_the_first_kept_copy(
    store: redis.Redis, broker: redis.Redis
) -> None:
    """The same copy of a task delivered again while it waits (its successor's id is new
    each time): the store refuses the second, and the kept copy stays the first's, the
    one the copy pointer names.  Delivered again after its turn was served (nothing is
    written: its entry is there until its copy arrives), the kept copy stays too: a
    restore brings back the first, not the second, and not nothing."""
    room = _room(store, broker)
    limit = Limit("kept", parse_rate("1/h"))
    line = {"limits": [limit], "blocking": limit, "place_us": 1, "kept": True}
    assert room.enqueue("e", b"first", "t", **line) > 0  # type: ignore[arg-type]
    assert room.enqueue("e", b"second", "t", **line) == 0  # type: ignore[arg-type]
    _, served = room.lines.serve_due(10, TIMEOUT_US)
    assert [s.entry for s in served] == ["e"]
    # (its limit's next start an hour away: it would wait, but its entry is there already)
    assert room.line_up("e", b"third", "t", within_us=500_000,
                        **line).ahead == -2  # type: ignore[arg-type]
    assert _kept(room) == 1
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 1
    assert [(t.entry, t.message) for t in room.lines.next_in_line(10)] == [("e", b"first")]


def test_purge_forgets_the_kept_copies(store: redis.Redis, broker: redis.Redis) -> None:
    """A purged task is not brought back by a later restore."""
    room = _room(store, broker)
    room.park("p", b"m", "t", delay_us=1_000_000, kept=True)
    room.purge()
    assert _kept(room) == 0
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 0


def test_with_the_setting_off_kept_copies_are_still_taken_and_restored(
    store: redis.Redis, broker: redis.Redis
) -> None:
    """Turned off, new waits are not kept (the store alone is not safe: countdowns), but a
    worker still has the keeper that takes and restores the copies kept before."""
    app = Celery("t", broker=_url(broker), set_as_current=False)
    app.conf.update(throttle_redis_url=_url(store), throttle_keep_beside_broker=False,
                    throttle_prefix=PREFIX)
    config = read_config(app)
    keeper = keeper_of(config, app)
    assert keeper is not None
    assert not durability_of(config, store).verdict().safe
    room = WaitingRoom(store, PREFIX, keeper=keeper)
    room.park("e", b"m", "t", delay_us=3_600_000_000, kept=True)  # (kept while it was on)
    restart_empty(store)
    room.take_due(10, TIMEOUT_US)
    assert room.restore_kept(room.last_epoch) == 1
    _, (copy,) = room.take_due(10, TIMEOUT_US)
    assert room.arrive("e", copy.token, copy.epoch, kept=True) > 0
    assert _kept(room) == 0
    keeper.close()


def _url(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/0"
