"""The ledger's rules (room/ledger.py): which waiting tasks a restore writes back, and which
copy of each taken one goes on, from the records in the broker's log."""

from __future__ import annotations

from celery_throttle.room.ledger import Record, Replay, replay


def put(entry: str, mark: str = "m1", value: bytes = b"msg") -> Record:
    return Record("put", entry, mark=mark, value=value)


def take(entry: str, token: str = "t1", epoch: int = 100) -> Record:
    return Record("take", entry, token=token, epoch=epoch)


def test_a_task_waits_from_its_put_until_its_take() -> None:
    found = replay([put("a", value=b"A"), put("b", value=b"B"), take("a")])
    assert found.live == {"b": ("m1", b"B")}
    assert found.taken == {"a": "t1"}


def test_a_drop_cancels_its_own_put_only() -> None:
    # The same message delivered again puts its entry again; the store refuses the second
    # put, whose drop must leave the first (all that may be left of the task).
    found = replay([put("a", "m1", b"first"), put("a", "m2", b"again"), Record("drop", "a", "m2")])
    assert found.live == {"a": ("m1", b"first")}
    found = replay([put("a", "m1"), Record("drop", "a", "m1")])
    assert found.live == {}
    assert found.taken == {}


def test_the_first_counted_take_names_the_copy_that_goes_on() -> None:
    # A dispatcher died after publishing; the entry was dispatched again: two copies take.
    found = replay([put("a"), take("a", "t1"), take("a", "t2")])
    assert found.taken == {"a": "t1"}
    assert found.live == {}


def test_a_taken_entry_stays_taken_whatever_is_put_for_it_later() -> None:
    # A compaction's copy of a put that raced with its take, or a redelivery of the
    # message that went on: neither makes it wait again.
    found = replay([put("a", "m1"), take("a"), put("a", "m1"), put("a", "m2")])
    assert found.live == {}
    assert found.taken == {"a": "t1"}


def test_a_take_from_a_store_lost_before_the_last_restore_does_not_count() -> None:
    # The store (epoch 100) was lost; a restore for epoch 200 read the log to its record
    # and wrote "a" back in line.  A copy dispatched in epoch 100 arriving after that
    # is refused (its entry waits in line again): its take must not end the entry,
    # which a later restore must write back again.
    found = replay([put("a"), Record("restored", epoch=200), take("a", "old", epoch=100)])
    assert found.live == {"a": ("m1", b"msg")}
    assert found.taken == {}
    # A copy dispatched after the restore counts, as does one from the lost epoch
    # that took before the restore read the log (it went on, or will).
    found = replay([put("a"), put("b"), take("b", "old", epoch=100),
                    Record("restored", epoch=200), take("a", "new", epoch=200)])
    assert found.live == {}
    assert found.taken == {"a": "new", "b": "old"}


def test_restores_only_raise_the_floor() -> None:
    found = replay([Record("restored", epoch=300), Record("restored", epoch=200),
                    put("a"), take("a", epoch=250)])
    assert found.floor == 300
    assert "a" in found.live


def test_a_replay_goes_on_where_another_ended() -> None:
    # (One generation of the log after another: their takes and puts meet.)
    first = replay([put("a"), put("b")])
    found = replay([take("a"), put("c")], into=first)
    assert found is first
    assert set(found.live) == {"b", "c"}
    assert isinstance(found, Replay)
