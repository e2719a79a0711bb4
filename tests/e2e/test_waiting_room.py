"""The waiting room with real prefork workers: parked on the server clock, dispatched once, in time.

Judged from the start records the tasks write and the result backend, as in
test_integration.py; every node here runs with ``throttle_waiting_room``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_throttle.testing import RedisServer

from .. import databases
from ..workers import (
    PICKLE,
    check_window_bound,
    logs,
    no_start_beyond,
    read_records,
    short_visibility,
    throttle_cli,
    wait_in_line,
    wait_results,
    worker_nodes,
)

pytestmark = pytest.mark.integration

#: The waiting room: a task that must wait waits in its limit's line
#: (tests/e2e/test_scheduler.py has the lines' ordering).
ROOM: dict[str, object] = {"throttle_waiting_room": True}


def test_waiting_tasks_run_once_in_their_turns_with_no_eta(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """40 tasks at 5/s (pickle, msgpack): in line, dispatched, each run once, no ETA, bound
    held."""
    with worker_nodes(redis_base, ("w1", "w2"), conf={**ROOM, **PICKLE}) as nodes:
        results = [capp.parked_pickle.delay(i, payload={1, 2}) for i in range(30)]
        results += [capp.parked_msgpack.delay(i) for i in range(30, 40)]
        rows = read_records(records, expect=40, timeout=40)
        states = wait_results(results, timeout=20)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 40
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    assert [r["eta"] for r in rows] == [None] * 40  # never an ETA message
    assert {r["kind"] for r in rows if "kind" in r} == {"set"}  # pickle's own types kept
    times = [r["t"] for r in rows]
    worst = check_window_bound(times, rate=5, burst=1, period=1.0)
    span = times[-1] - times[0]
    deferrals = sum(r["deferrals"] for r in rows) / len(rows)
    print(f"\nwaiting room: 40 at 5/s in {span:.2f}s (ideal 7.8), worst windows {worst}, "
          f"deferrals/task {deferrals:.2f}")
    assert span <= 7.8 / 0.9  # at least 90 % of the limit
    assert deferrals <= 1.1  # in line once, no hops
    assert "waiting room on" in text
    assert "waits in line" in text
    assert " ERROR" not in text


def test_waits_three_times_the_visibility_timeout_with_no_hops(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Broker visibility_timeout 4 s, waits up to 15 s: in line once, run once, never
    redelivered."""
    with worker_nodes(redis_base, ("w1", "w2"), conf={**ROOM, **short_visibility(4)}) as nodes:
        results = [capp.patient.delay(i) for i in range(16)]  # 1/s: the last waits ~15 s
        states = wait_results(results, timeout=40)
        read_records(records, expect=16, timeout=5)
        rows = no_start_beyond(records, 16, 2.0)  # a redelivered duplicate: the next sweep
        text = logs(nodes)
    assert states == ["SUCCESS"] * 16
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    starts = [r["t"] for r in rows]
    assert starts[-1] - starts[0] >= 14.0  # the longest wait was 3.5x the visibility timeout
    assert max(r["deferrals"] for r in rows) == 1  # in line once each, no hop through the broker
    assert "re-published" not in text
    check_window_bound(starts, rate=1, burst=1, period=1.0)


def test_dispatcher_killed_mid_dispatch_loses_nothing_and_runs_nothing_twice(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """A node dies after its dispatcher claimed a due task, before publishing: it runs once."""
    conf = {**ROOM, "throttle_dispatch_timeout": 3, **short_visibility(5)}
    with worker_nodes(redis_base, ("w1",), conf=conf, fault="dispatch.before_publish"):
        results = [capp.patient.delay(i) for i in range(8)]  # 1/s: all in line within 1 s
        deadline = time.monotonic() + 15
        while records.get("crashed") is None and time.monotonic() < deadline:
            time.sleep(0.05)
    crash = records.get("crashed")
    assert crash is not None, "the injected crash did not happen"
    killed = json.loads(crash)["t"]
    with worker_nodes(redis_base, ("w2",), conf=conf):
        states = wait_results(results, timeout=40)
        rows = read_records(records, expect=8, timeout=5)
    assert states == ["SUCCESS"] * 8
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    after = [r for r in rows if r["t"] > killed]
    assert len(after) == 7  # the first ran before the crash; the claimed one came back
    check_window_bound([r["t"] for r in rows], rate=1, burst=1, period=1.0)


def test_revoked_waiting_task_never_runs(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """app.control.revoke on a task in line: it is dispatched at once and discarded (REVOKED
    within seconds, not at its turn ~5.5 s later), the others run."""
    with worker_nodes(redis_base, ("w1",), conf=ROOM):
        results = [capp.patient.delay(i) for i in range(8)]  # 1/s: the 7th waits ~6 s
        wait_in_line(redis_base, 6, timeout=10)  # (the first starts at once)
        revoked = time.monotonic()
        capp.app.control.revoke(results[6].id)
        assert wait_results([results[6]], timeout=10) == ["REVOKED"]
        took = time.monotonic() - revoked
        states = wait_results(results, timeout=20)
        rows = read_records(records, expect=7, timeout=1)
    print(f"\na task in line revoked: REVOKED {took:.3f}s after the revoke")
    assert states == ["SUCCESS"] * 6 + ["REVOKED", "SUCCESS"]
    assert sorted(r["i"] for r in rows) == [0, 1, 2, 3, 4, 5, 7]
    assert took <= 2.5  # not at its turn


@pytest.fixture
def aof_store() -> Iterator[RedisServer]:
    """A store of its own that appends every write to disk (AOF, fsync always)."""
    server = RedisServer(None, "--appendonly", "yes", "--appendfsync", "always").start()
    yield server
    server.stop()


def test_store_killed_with_tasks_in_line_runs_each_once_after_restart(
    capp: ModuleType, records: redis.Redis, redis_base: str, aof_store: RedisServer
) -> None:
    """Store SIGKILLed for 3 s with tasks in line (AOF on): none starts meanwhile, all run
    once."""
    with worker_nodes(redis_base, ("w1", "w2"),
                      conf={**ROOM, "throttle_redis_url": f"{aof_store.url}/0"}) as nodes:
        results = [capp.patient.delay(i) for i in range(10)]  # 1/s: 9 s of waits
        wait_in_line(redis_base, 7, timeout=20, store=f"{aof_store.url}/0")
        aof_store.kill()
        killed = time.time()
        time.sleep(3.0)  # the outage
        restarted = time.time()
        aof_store.start()
        states = wait_results(results, timeout=40)
        rows = read_records(records, expect=10, timeout=5)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 10
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    # Nothing starts while the store is down, beyond a task that arrived
    # before the kill and slept up to its dispatch lead for its booked start.
    assert [r["t"] for r in rows if killed + 0.2 < r["t"] < restarted] == []
    # The buckets came back from the AOF: the bound holds with no extra burst.
    check_window_bound([r["t"] for r in rows], rate=1, burst=1, period=1.0)
    assert "dispatcher" in text  # the dispatcher reported the outage


def test_skewed_worker_clocks_cost_nothing_with_the_waiting_room(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Nodes at +3 s, -3 s and 0: tasks in line wait on Redis's clock, so the rate is kept.

    The countdown path loses most of the rate here (0.45 of the limit in
    test_faults.py's run): ETAs are set on one node's clock and waited for on
    another's.  Tasks in line have no ETA; their dispatch and their start are
    judged on the server's clock.
    """
    conf = {**ROOM, **PICKLE}
    with worker_nodes(redis_base, ("fast",), conf=conf, env={"CT_CLOCK_OFFSET": "3"}), worker_nodes(
            redis_base, ("slow",), conf=conf, env={"CT_CLOCK_OFFSET": "-3"}), worker_nodes(
            redis_base, ("true",), conf=conf):
        results = [capp.parked_msgpack.delay(i) for i in range(40)]  # 7.8 s at 5/s
        states = wait_results(results, timeout=40)
        rows = read_records(records, expect=40, timeout=5)
    assert states == ["SUCCESS"] * 40
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    times = [r["t"] for r in rows]
    worst = check_window_bound(times, rate=5, burst=1, period=1.0)
    utilisation = 7.8 / (times[-1] - times[0])
    print(f"\nskewed clocks with the waiting room: utilisation {utilisation:.2f}, "
          f"worst windows {worst}, hosts {sorted({r['host'] for r in rows})}")
    assert utilisation >= 0.9
    assert len({r["host"] for r in rows}) == 3  # every node ran some


def test_a_freed_seat_goes_to_the_oldest_waiter_at_once(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """concurrency=1: tasks in the seat's line start in their order, each right after the
    last ends."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=ROOM):
        first = capp.one_seat.delay(1.0)
        read_records(records, expect=1, timeout=10)  # the first holds the seat
        waiters = []
        for k in range(5):
            waiters.append(capp.one_seat.delay(0.3))
            wait_in_line(redis_base, k + 1, timeout=10)  # in line in this order
        states = wait_results([first, *waiters], timeout=30)
        rows = read_records(records, expect=6, timeout=5)
    assert states == ["SUCCESS"] * 6
    assert [r["id"] for r in rows] == [first.id] + [w.id for w in waiters]  # FIFO
    gaps = [b["t"] - (a["t"] + a["seconds"]) for a, b in itertools.pairwise(rows)]
    print(f"\ngaps between one run's end and the next start: "
          f"{[round(g, 3) for g in gaps]}")
    # Each freed seat is taken within one dispatch and one broker trip (the
    # paced return without the line would come back up to a second later).
    assert max(gaps) < 0.25
    assert min(gaps) > 0  # never two at once


def test_parked_lists_the_next_tasks_and_purge_needs_yes(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """`parked` lists the next tasks with their limit; `purge` drops them only with --yes,
    and then the result backend has them REVOKED (get() raises, never hangs) and their wait
    notes are gone."""
    from celery.exceptions import TaskRevokedError

    from celery_throttle.core.keys import task_key
    from celery_throttle.room.envelope import Envelope
    from celery_throttle.room.parking import WaitingRoom

    store = redis.Redis.from_url(f"{redis_base}/{databases.STORE}")  # the test app's store
    room = WaitingRoom(store, "throttle")
    parked_at = time.monotonic()
    for i, limit in enumerate(["llm", "other", "llm"]):
        message = Envelope(b"{}", "application/json", "utf-8", "", "celery",
                           {"id": f"id-{i}", "task": "proj.summarize"}).dumps()
        room.park(f"e{i}", message, f"id-{i}", delay_us=(10 + i) * 1_000_000,
                  note=json.dumps({"limit": limit}))
    listed = throttle_cli(["parked", "--limit", "llm"], redis_base)
    listed_within = time.monotonic() - parked_at
    refused = throttle_cli(["purge"], redis_base)
    still = room.state().parked
    purged = throttle_cli(["purge", "--yes"], redis_base)
    after = room.state().parked
    notes = store.exists(*(task_key("throttle", "wait", f"id-{i}") for i in range(3)))
    store.close()
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 2
    shown = re.match(r"^proj\.summarize\[id-0\] waits for limit 'llm': dispatched in "
                     r"(\d+\.\d{3})s$", lines[0])
    assert shown, lines
    # The wait shown is the 10 s given at the park less the time since: the CLI's
    # start alone takes over a second on a loaded machine.
    assert 10 - listed_within - 0.001 <= float(shown.group(1)) <= 10, (lines, listed_within)
    assert lines[1].startswith("proj.summarize[id-2] waits for limit 'llm'")
    assert refused.returncode == 2
    assert "would drop 3 waiting task(s)" in refused.stdout
    assert still == 3
    assert purged.returncode == 0, purged.stderr
    assert "dropped 3 waiting task(s); 3 marked REVOKED in the result backend" in purged.stdout
    assert after == 0
    assert notes == 0
    assert [capp.app.AsyncResult(f"id-{i}").state for i in range(3)] == ["REVOKED"] * 3
    with pytest.raises(TaskRevokedError, match="purged from the waiting room"):
        capp.app.AsyncResult("id-1").get(timeout=5)


@contextlib.contextmanager
def _sent_events(app: Any) -> Iterator[list[str]]:
    """The ids of the ``task-sent`` events the broker carries meanwhile (a receiver in a
    thread, listening before this yields: a probe event of its own has come through)."""
    seen: list[str] = []
    probes: list[object] = []

    def on_event(event: dict[str, Any]) -> None:
        if event.get("type") == "task-sent":
            seen.append(str(event.get("uuid")))
        elif event.get("type") == "probe-listening":
            probes.append(event)

    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None,
                                                                   wakeup=False), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            with app.events.default_dispatcher() as dispatcher:
                while not probes and time.monotonic() < deadline:
                    dispatcher.send("probe-listening")
                    time.sleep(0.2)
            assert probes, "the event receiver never heard its own probe"
            yield seen
        finally:
            receiver.should_stop = True
            thread.join(10)


@pytest.mark.parametrize("worker_events", [False, True], ids=["sent events",
                                                              "sent and worker events"])
def test_tasks_waiting_in_line_run_once_when_celery_sends_task_sent_events(
    capp: ModuleType, records: redis.Redis, redis_base: str,
    monkeypatch: pytest.MonkeyPatch, worker_events: bool
) -> None:
    """With ``task_send_sent_event`` on (and the node's task events), 12 tasks sent at once
    to a 2/s limit wait in line, are dispatched and each runs once; each send emitted one
    ``task-sent`` event (the user's), and the waiting room's copies none of their own."""
    conf: dict[str, object] = {**ROOM, "task_send_sent_event": True,
                               "worker_send_task_events": worker_events}
    monkeypatch.setitem(capp.app.conf, "task_send_sent_event", True)
    with _sent_events(capp.app) as sent, worker_nodes(
            redis_base, ("w1",), concurrency=2, conf=conf,
            env={"CT_LINE_RATE": "2/s"}) as nodes:
        results = [capp.in_line.delay(i) for i in range(12)]
        rows = read_records(records, expect=12, timeout=30)
        states = wait_results(results, timeout=20)
        text = logs(nodes)
        no_start_beyond(records, 12, 1.0)
        ids = [r.id for r in results]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not set(ids) <= set(sent):
            time.sleep(0.05)
    assert states == ["SUCCESS"] * 12
    assert Counter(r["id"] for r in rows) == Counter(ids)  # exactly once
    assert "waits in line" in text
    assert Counter(sent) == Counter(ids)  # one event per send, none for a copy
    check_window_bound([r["t"] for r in rows], rate=2, burst=1, period=1.0)
    assert " ERROR" not in text
