"""lua/copies.lua on a real Redis: which copy of an acks_late message may go on."""

from __future__ import annotations

import pytest
import redis

from celery_throttle.core.scripts import source

SCRIPT = source("celery_throttle.integration", "copies.lua")


@pytest.fixture
def go(client: redis.Redis, prefix: str):  # type: ignore[no-untyped-def]
    """go(mine, prev, then) -> may it go on, on this test's own pointer key."""
    script = client.register_script(SCRIPT)
    key = f"{{{prefix}}}:copy:task:0"

    def call(mine: str, prev: str, then: str) -> bool:
        return int(script(keys=[key], args=[mine, prev, then, 60_000])) == 1

    return call


def test_user_message_starts_and_its_redelivery_reruns(go) -> None:  # type: ignore[no-untyped-def]
    """The user's message starts; its redelivery after a crash mid-run may run again."""
    assert go("-", "", "ran:-")
    assert go("-", "", "ran:-")


def test_crash_after_move_drops_the_old_copy(go) -> None:  # type: ignore[no-untyped-def]
    """X re-published Y and moved the pointer, then died before its ack: X is refused."""
    assert go("-", "", "Y")  # X ("-") hands over to Y
    assert not go("-", "", "ran:-")  # X redelivered
    assert go("Y", "-", "ran:Y")


def test_crash_before_move_lets_exactly_one_through(go) -> None:  # type: ignore[no-untyped-def]
    """Y published, pointer not moved (crash or store down): the first to go on wins."""
    assert go("Y", "-", "ran:Y")  # Y arrives first and starts
    assert not go("-", "", "ran:-")  # the redelivered original is refused
    assert go("Y", "-", "ran:Y")  # Y's own redelivery after a crash mid-run still runs


def test_crash_before_move_original_first(go) -> None:  # type: ignore[no-untyped-def]
    """The redelivered original gets there first and runs: the stray successor is refused."""
    assert go("-", "", "ran:-")
    assert go("-", "", "done:-")
    assert not go("Y", "-", "ran:Y")
    assert not go("-", "", "ran:-")  # nor is the original redelivered after its run ended


def test_started_copy_redelivered_and_re_published(go) -> None:  # type: ignore[no-untyped-def]
    """X started, died mid-run, came back and was re-published as Y (store down): Y runs."""
    assert go("-", "", "ran:-")
    assert go("Y", "-", "ran:Y")  # "ran:-", not "done:-": Y's predecessor did not finish


def test_stale_lineage_is_refused(go) -> None:  # type: ignore[no-untyped-def]
    """A copy whose predecessor is not the pointer's copy belongs to a dead branch."""
    assert go("-", "", "Y")
    assert go("Y", "-", "Z")
    assert not go("W", "-", "ran:W")  # another successor of the original
    assert not go("Y", "-", "ran:Y")  # Y again, after it handed over
    assert go("Z", "Y", "ran:Z")


@pytest.mark.parametrize("first", ["-", "c1"])
def test_hops_while_the_store_is_down_keep_the_pointers_copy(
        client: redis.Redis, prefix: str, first: str) -> None:
    """Three store-down re-publishes in a row (the pointer never moved): the last copy
    still goes on once the store is back, and the older ones are refused after it."""
    from celery_throttle.integration.copies import CopyPointer
    from celery_throttle.room.header import WaitState

    pointer = CopyPointer(client, prefix, 60)
    known = WaitState() if first == "-" else WaitState(copy="c1", prev="-")
    if first != "-":
        assert pointer.move("t", 0, WaitState(), "c1") == "go"  # the user's message handed over
    hops = [known]
    for copy in ("h1", "h2", "h3"):
        hops.append(hops[-1].unmoved_successor(copy))
    assert [h.prev for h in hops[1:]] == [known.copy_id] * 3
    assert pointer.move("t", 0, hops[-1], "ran:") == "go"
    assert pointer.move("t", 0, hops[1], "ran:") == "running"  # an older hop, redelivered
    assert hops[-1].to_header()["unmoved"] == 1


def test_a_store_that_lost_the_pointer_lets_the_re_published_copy_run(
        client: redis.Redis, prefix: str) -> None:
    """The store comes back empty while a copy re-published during its outage waits: that
    copy, naming a predecessor the store no longer knows, goes on, and only once."""
    from celery_throttle.core.keys import copy_key
    from celery_throttle.integration.copies import CopyPointer
    from celery_throttle.room.header import WaitState

    pointer = CopyPointer(client, prefix, 60)
    assert pointer.move("t", 0, WaitState(), "c1") == "go"  # the user's message handed over to c1
    c1 = WaitState(copy="c1", prev="-")
    c2 = c1.unmoved_successor("c2")  # c1 re-published while the store was down
    client.delete(copy_key(prefix, "t", 0))  # ... which then restarted with nothing
    assert pointer.move("t", 0, c2, "ran:") == "go"
    assert pointer.move("t", 0, c1, "ran:") == "running"  # c1 redelivered while c2 runs
    assert pointer.move("t", 0, c2, "done:") == "go"
    assert pointer.move("t", 0, c2, "ran:") == "stale"


def test_a_copy_refused_while_another_runs_says_so(client: redis.Redis, prefix: str) -> None:
    """A stale copy refused while the copy that took the pointer runs is told apart from
    one refused after the task ended: the seats under the task's id are the runner's."""
    from celery_throttle.integration.copies import CopyPointer
    from celery_throttle.room.header import WaitState

    pointer = CopyPointer(client, prefix, 60)
    assert pointer.move("t", 0, WaitState(), "c1") == "go"
    c1 = WaitState(copy="c1", prev="-")
    assert pointer.move("t", 0, c1, "ran:") == "go"
    assert pointer.move("t", 0, WaitState(copy="c9", prev="-"), "ran:") == "running"
    assert pointer.move("t", 0, c1, "done:") == "go"
    assert pointer.move("t", 0, WaitState(copy="c9", prev="-"), "ran:") == "stale"


def test_a_copy_past_the_latest_start_moves_nothing(client: redis.Redis, prefix: str) -> None:
    """A copy admitted for a start, checked in the pointer's move on the server's clock: past
    its latest start it is "late" and the pointer still names it; in time it goes on."""
    from celery_throttle.core.keys import copy_key
    from celery_throttle.integration.copies import CopyPointer
    from celery_throttle.room.header import WaitState

    pointer = CopyPointer(client, prefix, 60)
    sec, usec = client.time()
    now = int(sec) * 1_000_000 + int(usec)
    assert pointer.move("t", 0, WaitState(), "c1") == "go"
    c1 = WaitState(copy="c1", prev="-")
    assert pointer.move("t", 0, c1, "ran:", latest_us=now - 1) == "late"
    assert client.get(copy_key(prefix, "t", 0)) == b"c1"
    assert pointer.move("t", 0, c1, "ran:", latest_us=now + 60_000_000) == "go"
    assert client.get(copy_key(prefix, "t", 0)) == b"ran:c1"
