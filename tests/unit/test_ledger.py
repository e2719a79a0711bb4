"""The ledger's rules (room/ledger.py): which waiting tasks a restore writes back, and which
copy of each taken one goes on, from the records in the broker's log."""

from __future__ import annotations

from celery_throttle.room.ledger import Record, Replay, replay


def put(entry: str, mark: str = "m1", value: bytes = b"msg") -> Record:
    return Record("put", entry, mark=mark, value=value)


def take(entry: str, token: str = "t1", at: int = 5) -> Record:
    return Record("take", entry, token=token, at=at)


def test_a_task_waits_from_its_put_until_its_take() -> None:
    found = replay([put("a", value=b"A"), put("b", value=b"B"), take("a")])
    assert found.live == {"b": ("m1", b"B")}
    assert found.taken == {"a": ("t1", 5)}


def test_a_drop_cancels_its_own_put_only() -> None:
    # The same message delivered again puts its entry again; the store refuses the second
    # put, whose drop must leave the first (all that may be left of the task).
    found = replay([put("a", "m1", b"first"), put("a", "m2", b"again"), Record("drop", "a", "m2")])
    assert found.live == {"a": ("m1", b"first")}
    found = replay([put("a", "m1"), Record("drop", "a", "m1")])
    assert found.live == {}
    assert found.taken == {}
    # Read before its put (the two in different generations of the log), it still counts.
    found = replay([Record("drop", "a", "m1"), put("a", "m1"), put("b", "m1")])
    assert set(found.live) == {"b"}


def test_the_first_counted_take_names_the_copy_that_goes_on() -> None:
    # A dispatcher died after publishing; the entry was dispatched again: two copies take.
    found = replay([put("a"), take("a", "t1"), take("a", "t2", at=6)])
    assert found.taken == {"a": ("t1", 5)}
    assert found.live == {}


def test_a_taken_entry_stays_taken_whatever_is_put_for_it_later() -> None:
    # A compaction's copy of a put that raced with its take, or a redelivery of the
    # message that went on: neither makes it wait again.
    found = replay([put("a", "m1"), take("a"), put("a", "m1"), put("a", "m2")])
    assert found.live == {}
    assert found.taken == {"a": ("t1", 5)}


def test_a_mark_changes_nothing() -> None:
    found = replay([put("a"), Record("mark", token="reader"), take("b")])
    assert found.live == {"a": ("m1", b"msg")}
    assert found.taken == {"b": ("t1", 5)}


def test_a_replay_goes_on_where_another_ended() -> None:
    # (One generation of the log after another: their takes and puts meet.)
    first = replay([put("a"), put("b")])
    found = replay([take("a"), put("c")], into=first)
    assert found is first
    assert set(found.live) == {"b", "c"}
    assert isinstance(found, Replay)
