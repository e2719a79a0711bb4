"""lua/copies.lua on a real Redis: which copy of an acks_late message may go on."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.exceptions import Ignore

from celery_throttle.core.keys import copy_key
from celery_throttle.core.scripts import script
from celery_throttle.integration.runtime import runtime_for
from celery_throttle.room.header import HEADER, WaitState

SCRIPT = script("celery_throttle.integration", "copies.lua")


@pytest.fixture
def go(client: redis.Redis, prefix: str):  # type: ignore[no-untyped-def]
    """go(mine, prev, then) -> may it go on, on this test's own pointer key."""
    script = client.register_script(SCRIPT)
    key = f"{{{prefix}}}:copy:task:0"

    def call(mine: str, prev: str, then: str) -> bool:
        return int(script(keys=[key], args=[mine, prev, then, 60_000])) in (1, 5)

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
    assert pointer.move("t", 0, c2, "ran:") == "ended"


def test_a_copy_refused_while_another_runs_says_so(client: redis.Redis, prefix: str) -> None:
    """A copy refused while the copy that took the pointer runs, after the task's run ended,
    or for a newer copy, is told which: only after the end are the seats under the task's
    id nobody else's."""
    from celery_throttle.integration.copies import CopyPointer
    from celery_throttle.room.header import WaitState

    pointer = CopyPointer(client, prefix, 60)
    assert pointer.move("t", 0, WaitState(), "c1") == "go"
    c1 = WaitState(copy="c1", prev="-")
    assert pointer.move("t", 0, c1, "ran:") == "go"
    assert pointer.move("t", 0, WaitState(copy="c9", prev="-"), "ran:") == "running"
    assert pointer.move("t", 0, c1, "done:") == "go"
    assert pointer.move("t", 0, WaitState(copy="c9", prev="-"), "ran:") == "ended"
    assert pointer.move("t", 1, WaitState(), "c2") == "go"  # (the next retry's pointer)
    assert pointer.move("t", 1, WaitState(copy="c1", prev="-"), "ran:") == "stale"


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


@pytest.fixture
def seat_app(redis_url: str, prefix: str) -> Iterator[tuple[Celery, Task[Any, Any], list[str]]]:
    """An installed app (its waiting room on) with an acks_late task of one seat, and the
    task ids its runs started."""
    from celery_throttle import throttled

    from ..conftest import installed_app

    starts: list[str] = []
    with installed_app("copies", redis_url, prefix) as app:
        @throttled(concurrency=1, name="one-seat")
        @app.task(name="copies.job", bind=True, shared=False, acks_late=True)
        def job(self: Task[Any, Any]) -> str:
            starts.append(str(self.request.id))
            return "ran"

        yield app, job, starts


def _run(job: Task[Any, Any], state: WaitState, *, redelivered: bool = False) -> str:
    """Run a copy of task "t-1" carrying ``state``, as a worker's pool would (``redelivered``:
    the broker flagged this delivery as its redelivery)."""
    job.push_request(id="t-1", called_directly=False,
                     delivery_info={"redelivered": redelivered}, retries=0,
                     headers={HEADER: state.to_header()})
    try:
        return str(job.run())
    finally:
        job.pop_request()


def test_a_stale_copy_leaves_the_seat_its_newer_copy_was_given(
    seat_app: tuple[Celery, Task[Any, Any], list[str]], client: redis.Redis, prefix: str
) -> None:
    """A copy delivered again after it was re-published is dropped, and the seat held under
    the task's id stays: it is the newer copy's (given at that copy's dispatch, on its way
    to a worker), which then starts on it instead of finding it gone."""
    from celery_throttle import Concurrency, Gate

    _, job, starts = seat_app
    seat = Concurrency("one-seat", 1)
    gate = Gate(client, prefix=prefix)
    assert gate.acquire_many([seat], holder="t-1").allowed  # the newer copy's seat ...
    client.set(copy_key(prefix, "t-1", 0), "c2", px=60_000)  # ... and "c1" made "c2"
    with pytest.raises(Ignore):
        _run(job, WaitState(copy="c1", prev="-"))  # the old copy, delivered again
    assert gate.inspect_leases(seat).held == 1
    assert starts == []
    assert _run(job, WaitState(copy="c2", prev="c1")) == "ran"
    assert starts == ["t-1"]
    assert gate.inspect_leases(seat).held == 0


def test_a_stale_copy_finding_the_seats_full_puts_nothing_in_line(
    seat_app: tuple[Celery, Task[Any, Any], list[str]], client: redis.Redis, prefix: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A copy delivered again after it was re-published, with every seat taken, is dropped
    before it would join the line: no second copy of the task waits there (it would be
    refused when served, its kept copy left behind) and no seat is given back."""
    from celery_throttle import Concurrency, Gate

    app, job, starts = seat_app
    seat = Concurrency("one-seat", 1)
    gate = Gate(client, prefix=prefix)
    assert gate.acquire_many([seat], holder="another").allowed
    client.set(copy_key(prefix, "t-1", 0), "c2", px=60_000)
    room = runtime_for(app).room
    with caplog.at_level(logging.INFO, logger="celery_throttle"), pytest.raises(Ignore):
        _run(job, WaitState(copy="c1", prev="-"))
    assert "dropped: a stale copy" in caplog.text
    assert "waits in line" not in caplog.text
    assert room.lines.next_in_line(5, "one-seat") == []
    assert gate.inspect_leases(seat).held == 1
    assert client.get(copy_key(prefix, "t-1", 0)) == b"c2"
    assert starts == []


def test_a_start_of_a_task_acknowledged_early_is_its_copys_only_one(
        client: redis.Redis, prefix: str) -> None:
    """Without acks_late no crash redelivers a started copy: a second start of it is the
    same message delivered twice, refused as "running" (then "ended" once its run ended).
    The move to a successor (the provider refused the running copy) still goes on."""
    from celery_throttle.integration.copies import CopyPointer

    pointer = CopyPointer(client, prefix, 60)
    c1 = WaitState(copy="c1", prev="-")
    assert pointer.move("t", 0, c1, "ran:", once=True) == "go"
    assert pointer.move("t", 0, c1, "ran:", once=True) == "running"
    assert pointer.move("t", 0, c1, "c2") == "go"  # re-published by its run (a 429)
    c2 = WaitState(copy="c2", prev="c1")
    assert pointer.move("t", 0, c2, "ran:", once=True) == "go"
    assert pointer.move("t", 0, c2, "done:") == "go"
    assert pointer.move("t", 0, c2, "ran:", once=True) == "ended"


def test_a_copy_of_a_task_acknowledged_early_delivered_twice_runs_once(
    redis_url: str, prefix: str, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy the throttle published of a task without acks_late, delivered twice (the
    broker's at-least-once: RabbitMQ's dead-lettering between the delay ladder's rungs, a
    Redis broker's ETA message held past its visibility timeout): the first delivery runs,
    the second is dropped.  The task's own message asks no pointer."""
    from celery_throttle import throttled

    from ..conftest import installed_app

    starts: list[str] = []
    with installed_app("early", redis_url, prefix) as app:
        @throttled("100/s", name="early-ack")
        @app.task(name="copies.early", bind=True, shared=False)
        def early(self: Task[Any, Any]) -> str:
            starts.append(str(self.request.id))
            return "ran"

        copy = WaitState(copy="c1", prev="-")
        assert _run(early, copy) == "ran"
        with caplog.at_level(logging.INFO, logger="celery_throttle"), pytest.raises(Ignore):
            _run(early, copy)  # the same copy, delivered again
        assert "dropped: another copy of it has started" in caplog.text
        assert starts == ["t-1"]
        early.push_request(id="t-2", called_directly=False, delivery_info={}, retries=0,
                           headers={})
        try:
            assert early.run() == "ran"  # the user's message
        finally:
            early.pop_request()
        assert client.get(copy_key(prefix, "t-2", 0)) is None


def test_an_acks_late_copy_runs_again_only_when_the_broker_redelivers_it(
    seat_app: tuple[Celery, Task[Any, Any], list[str]], client: redis.Redis, prefix: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    """An acks_late copy that started is delivered again.  Unflagged (the delay ladder's
    at-least-once dead-lettering, a publish the broker took twice) it is dropped while the
    first runs; flagged as the broker's redelivery (its run was cut off before its
    acknowledgement) it runs again, acks_late's at-least-once."""
    _, job, starts = seat_app
    copy = WaitState(copy="c1", prev="-")
    assert _run(job, copy) == "ran"  # (no task_postrun here: the pointer stays "ran:c1")
    with caplog.at_level(logging.INFO, logger="celery_throttle"), pytest.raises(Ignore):
        _run(job, copy)
    assert "dropped: another copy of it has started" in caplog.text
    assert starts == ["t-1"]
    assert _run(job, copy, redelivered=True) == "ran"
    assert starts == ["t-1", "t-1"]
    assert client.get(copy_key(prefix, "t-1", 0)) == b"ran:c1"


def test_a_started_copy_delivered_again_is_told_apart_as_a_run_again(
    client: redis.Redis, prefix: str
) -> None:
    """A copy that started, delivered again where it may run again (the broker's redelivery
    after a crash mid-run), goes on as a run again ("rerun", asked or moved); where it may
    not, it is refused while the first runs; before its start it is a plain "go"."""
    from celery_throttle.integration.copies import CopyPointer

    pointer = CopyPointer(client, prefix, 60)
    c1 = WaitState(copy="c1", prev="-")
    assert pointer.move("t", 0, WaitState(), "c1") == "go"
    assert pointer.check("t", 0, c1) == "go"
    assert pointer.move("t", 0, c1, "ran:") == "go"
    assert pointer.check("t", 0, c1) == "rerun"
    assert pointer.move("t", 0, c1, "ran:", once=True) == "running"
    assert pointer.move("t", 0, c1, "ran:") == "rerun"
    assert client.get(copy_key(prefix, "t", 0)) == b"ran:c1"


def test_a_run_again_after_a_crash_takes_a_start_of_its_own(
    redis_url: str, client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An acks_late copy booked for a start runs on it; the broker's redelivery of it (its
    node died mid-run) does not run again on that spent start: it asks the limit afresh
    and waits for the limit's next start (in line here), saying why in the log and in
    ``celery throttle why``.  A later delivery of the old copy is refused."""
    from celery_throttle import Gate, Limit, throttled
    from celery_throttle.core.rates import parse_rate
    from celery_throttle.integration.notes import read_wait
    from celery_throttle.room.header import spacing_of

    from ..conftest import installed_app

    limit = Limit("rerun-rate", parse_rate("4/s"))
    starts: list[int] = []
    with installed_app("rerun", redis_url, prefix) as app:
        @throttled("4/s", name="rerun-rate")
        @app.task(name="copies.rerun", bind=True, shared=False, acks_late=True)
        def job(self: Task[Any, Any]) -> str:
            sec, usec = client.time()
            starts.append(int(sec) * 1_000_000 + int(usec))
            return "ran"

        gate = Gate(client, prefix=prefix)
        assert gate.acquire_many([limit]).allowed  # the start before it
        booking = gate.acquire_many([limit], reserve=1.0).reservation
        assert booking is not None
        copy = WaitState(copy="c1", prev="-", start=booking.start, booked=booking.booked,
                         epoch=booking.epoch, shift=booking.shift, spacing=spacing_of([limit]))
        client.set(copy_key(prefix, "t-1", 0), "c1", px=60_000)
        assert _run(job, copy) == "ran"  # on its booked start (the pointer stays "ran:c1")
        with caplog.at_level(logging.INFO, logger="celery_throttle"), pytest.raises(Ignore):
            _run(job, copy, redelivered=True)
        note = read_wait(runtime_for(app), "t-1")
        with pytest.raises(Ignore):
            _run(job, copy)  # (not flagged: another delivery of the same copy)
    assert len(starts) == 1
    assert starts[0] >= booking.start
    assert "run again after its node died: waits for a start" in caplog.text
    assert "waits in line for limit 'rerun-rate'" in caplog.text
    assert note is not None
    assert (note["limit"], note["rerun"]) == ("rerun-rate", True)
