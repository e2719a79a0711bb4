"""The scheduler with real prefork workers: waiting tasks in line, ordered and dispatched in time.

Every node here runs with the defaults: a task that must wait longer than a sleep
in the worker waits unbooked in the queue of its limit, and its limits are
charged when the dispatcher gives it its turn.  Judged from the
start records and the result backend, as in test_waiting_room.py.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
import time
from collections import Counter
from types import ModuleType

import pytest
import redis

from celery_throttle import parse_rate
from celery_throttle.integration.defer import _MAX_SLEEPS
from celery_throttle.testing import WorkerProcess

from ..servers import until
from ..workers import (
    check_window_bound,
    logs,
    read_records,
    throttle_cli,
    wait_in_line,
    wait_results,
    worker_nodes,
)

pytestmark = pytest.mark.integration

LINE: dict[str, object] = {}  # (the defaults)
# kombu's Redis transport delivers priority 0 first: the batch goes last.
BATCH, URGENT = 9, 0


def test_urgent_task_starts_ahead_of_a_waiting_batch(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """40 batch tasks wait in line at 5/s; an urgent one sent after them starts within ~1
    interval."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=LINE) as nodes:
        batch = [capp.in_line.apply_async((i,), priority=BATCH) for i in range(40)]
        wait_in_line(redis_base, 30, timeout=20)
        sent = time.time()
        urgent = capp.in_line.apply_async((1000,), priority=URGENT)
        why = throttle_cli(["why", batch[-1].id], redis_base)
        shown = throttle_cli(["status", "line"], redis_base)
        listed = throttle_cli(["parked", "--limit", "line", "-n", "3"], redis_base)
        states = wait_results([*batch, urgent], timeout=40)
        rows = read_records(records, expect=41, timeout=5)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 41
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in [*batch, urgent])
    start = next(r["t"] for r in rows if r["i"] == 1000)
    after = sum(1 for r in rows if r["i"] != 1000 and r["t"] > start)
    print(f"\nurgent behind 40 waiting: started {start - sent:.3f}s after it was sent, "
          f"{after} batch tasks after it")
    assert start - sent <= 1.5  # one interval (0.2 s) and the trips, not the batch's 8 s
    assert after >= 25
    check_window_bound([r["t"] for r in rows], rate=5, burst=1, period=1.0)
    assert "waits in line" in text
    assert " ERROR" not in text
    assert re.search(r"is number \d+ in line and waits for limit 'line'", why.stdout), why.stdout
    assert re.search(r"\d+ in line, drains in ~[\d.]+s", shown.stdout), shown.stdout
    assert re.findall(r"^tests\.celery_app\.in_line\[[-\w]+\] waits in line for limit "
                      r"'line': place (\d)$", listed.stdout, flags=re.MULTILINE) == \
        ["0", "1", "2"], listed.stdout


def test_a_freed_concurrency_seat_goes_to_an_urgent_waiter_first(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """concurrency=1: four batch tasks wait in the seat's line, then an urgent one: the
    urgent task is served the next seat freed, and the batch follows in its order."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=LINE):
        first = capp.one_seat.apply_async((2.0,), priority=BATCH)
        read_records(records, expect=1, timeout=10)  # the first holds the seat
        batch = []
        for k in range(4):
            batch.append(capp.one_seat.apply_async((0.3,), priority=BATCH))
            wait_in_line(redis_base, k + 1, timeout=10)  # they wait in this order
        urgent = capp.one_seat.apply_async((0.3,), priority=URGENT)
        states = wait_results([first, *batch, urgent], timeout=30)
        rows = read_records(records, expect=6, timeout=5)
    assert states == ["SUCCESS"] * 6
    assert [r["id"] for r in rows] == [first.id, urgent.id] + [b.id for b in batch]
    gaps = [b["t"] - (a["t"] + a["seconds"]) for a, b in itertools.pairwise(rows)]
    print(f"\ngaps between one run's end and the next start "
          f"{[round(g, 3) for g in gaps]}")
    assert min(gaps) > 0, gaps  # never two at once
    assert max(gaps) < 0.25, gaps  # each seat handed over at once


def _revoked_left(nodes: list[WorkerProcess]) -> bool:
    """The node heard the revoke broadcast and took the revoked tasks out of their lines."""
    return "revoked task(s) left the waiting room at once" in logs(nodes)


@pytest.mark.parametrize("how", ["purge", "revoke"])
def test_cancelling_the_waiting_tasks_frees_the_limit_at_once(
    capp: ModuleType, records: redis.Redis, redis_base: str, how: str
) -> None:
    """After `throttle purge --yes`, or revoking them, drops 40 waiting tasks, a new task
    starts within ~1 interval (not behind their turns: 8 s)."""
    with worker_nodes(redis_base, ("w1",), conf=LINE) as nodes:
        batch = [capp.in_line.apply_async((i,), priority=BATCH) for i in range(40)]
        wait_in_line(redis_base, 30, timeout=20)
        reached = time.monotonic()
        if how == "purge":
            done = throttle_cli(["purge", "--yes"], redis_base)
            assert done.returncode == 0, done.stderr
        else:
            capp.app.control.revoke([r.id for r in batch])
            until("the revoked tasks leave the line", lambda: _revoked_left(nodes), 10)
        # (The line goes on at its pace while the command starts: a loaded machine takes
        # seconds to start the CLI.)
        pace = parse_rate(capp.LINE_RATE).per_second
        served = 10 + math.ceil((time.monotonic() - reached) * pace)
        sent = time.time()
        fresh = capp.in_line.delay(1000)
        assert wait_results([fresh], timeout=20) == ["SUCCESS"]
        rows = read_records(records, expect=41, timeout=1)
        dropped = wait_results(batch, timeout=10)
    start = next(r["t"] for r in rows if r["i"] == 1000)
    print(f"\nafter {how}: a new task started {start - sent:.3f}s after it was sent")
    assert start - sent <= 1.5
    ran = dropped.count("SUCCESS")
    assert dropped.count("REVOKED") == 40 - ran >= 40 - served - 1
    assert len(rows) == ran + 1  # the dropped tasks never ran


def test_revoked_tasks_leave_their_line_at_once_wherever_they_wait(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """150 tasks wait in line at 1/s (150 s of turns), all revoked: a new task of the same
    priority sent just after starts within ~1 interval, none of them takes a turn of the
    limit, and each is REVOKED within seconds, not at its turn."""
    with worker_nodes(redis_base, ("w1",), conf=LINE, env={"CT_LINE_RATE": "1/s"}) as nodes:
        batch = [capp.in_line.apply_async((i,), priority=BATCH) for i in range(150)]
        wait_in_line(redis_base, 145, timeout=30)
        revoked = time.time()
        capp.app.control.revoke([r.id for r in batch])
        until("the revoked tasks leave the line", lambda: _revoked_left(nodes), 10)
        sent = time.time()
        fresh = capp.in_line.apply_async((1000,), priority=BATCH)
        assert wait_results([fresh], timeout=30) == ["SUCCESS"]
        states = wait_results(batch, timeout=20)
        settled = time.time() - revoked
        rows = read_records(records, expect=1, timeout=1)
        text = logs(nodes)
    ran = [r["i"] for r in rows if r["i"] != 1000]
    start = next(r["t"] for r in rows if r["i"] == 1000)
    print(f"\nall 150 revoked: a new task started {start - sent:.3f}s after it was sent; "
          f"{states.count('REVOKED')} REVOKED within {settled:.3f}s ({len(ran)} had started)")
    assert states.count("REVOKED") + len(ran) == 150, Counter(states)
    assert states.count("REVOKED") >= 140
    assert start - sent <= 2.5  # one interval (1 s) and the trips, not 15 s of heads
    assert settled <= 8  # each at once (0.7 s), not 9 per interval (15 s)
    assert "revoked task(s) left the waiting room at once" in text
    assert " ERROR" not in text


def test_waiting_tasks_follow_a_new_rate_in_the_code(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """60 tasks in line at 2/s; the node restarted with 20/s drains the rest at 20/s."""
    with worker_nodes(redis_base, ("w1",), conf=LINE, env={"CT_LINE_RATE": "2/s"}) as old:
        results = [capp.in_line.delay(i) for i in range(60)]
        wait_in_line(redis_base, 50, timeout=20)
        # A warm shutdown (SIGTERM to the main process): the tasks it runs finish.
        os.kill(old[0].proc.pid, signal.SIGTERM)
        old[0].proc.wait(30)
        text = logs(old)  # (its log file goes with the node)
    restarted = time.time()
    with worker_nodes(redis_base, ("w2",), conf=LINE, env={"CT_LINE_RATE": "20/s"}) as new:
        states = wait_results(results, timeout=30)
        rows = read_records(records, expect=60, timeout=2)
        text += logs(new)
    assert states == ["SUCCESS"] * 60
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)
    later = sorted(r["t"] for r in rows if r["t"] > restarted)
    span = later[-1] - later[0]
    print(f"\nafter the restart at 20/s: {len(later)} in {span:.2f}s "
          f"(at 2/s: {(len(later) - 1) / 2:.1f}s)")
    assert len(later) >= 45
    assert span <= (len(later) - 1) / 20 / 0.8 + 1.0  # the new pace, not the old 2/s
    check_window_bound(later, rate=20, burst=1, period=1.0)
    assert " ERROR" not in text


def test_throttle_set_drains_the_waiting_tasks_at_the_new_rate(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """60 tasks in line at 2/s; `throttle set line 20/s` drains the rest at 20/s from the
    next second, and `throttle status` shows both rates."""
    with worker_nodes(redis_base, ("w1",), conf=LINE, env={"CT_LINE_RATE": "2/s"}) as nodes:
        results = [capp.in_line.delay(i) for i in range(60)]
        wait_in_line(redis_base, 50, timeout=20)
        done = throttle_cli(["set", "line", "20/s"], redis_base)
        changed = time.time()
        assert done.returncode == 0, done.stderr
        shown = throttle_cli(["status", "line"], redis_base)
        states = wait_results(results, timeout=30)
        rows = read_records(records, expect=60, timeout=2)
        assert throttle_cli(["unset", "line"], redis_base).returncode == 0
        text = logs(nodes)
    assert states == ["SUCCESS"] * 60
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)
    assert "20/s (set; code " in shown.stdout  # (the code as the command's app declares it)
    later = sorted(r["t"] for r in rows if r["t"] > changed + 1.0)  # from the next second
    span = later[-1] - later[0]
    print(f"\nafter throttle set 20/s: {len(later)} in {span:.2f}s "
          f"(at 2/s: {(len(later) - 1) / 2:.1f}s)")
    assert len(later) >= 20  # enough starts to judge the pace by
    assert span <= (len(later) - 1) / 20 / 0.8 + 0.5
    check_window_bound(later, rate=20, burst=1, period=1.0)
    assert " ERROR" not in text


def test_throttle_pause_holds_the_waiting_tasks_until_resume(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """`throttle pause line`: nothing starts while paused; `throttle resume line`: the
    waiting tasks start again within a second."""
    # (At 10/s the node's 4 processes would each sleep out a booked wait of
    # 0.4 s, under throttle_max_sleep: nothing would wait in line.)
    with worker_nodes(redis_base, ("w1",), conf=LINE, env={"CT_LINE_RATE": "5/s"}):
        results = [capp.in_line.delay(i) for i in range(30)]
        wait_in_line(redis_base, 20, timeout=20)
        paused = throttle_cli(["pause", "line"], redis_base)
        assert paused.returncode == 0, paused.stderr
        held_from = time.time() + 0.6  # a task dispatched just before may still start
        time.sleep(2.5)  # paused: nothing may start
        resume_called = time.time()  # (the command takes a second to start)
        resumed = throttle_cli(["resume", "line"], redis_base)
        resumed_at = time.time()
        assert resumed.returncode == 0, resumed.stderr
        states = wait_results(results, timeout=30)
        rows = read_records(records, expect=30, timeout=2)
    assert "resumed" in resumed.stdout
    assert states == ["SUCCESS"] * 30
    during = [r for r in rows if held_from < r["t"] < resume_called]
    after = sorted(r["t"] for r in rows if r["t"] >= resume_called)
    print(f"\npaused: {len(during)} starts in the {resume_called - held_from:.1f}s paused; "
          f"the first after resume {after[0] - resumed_at:+.3f}s from the command's end")
    assert during == []
    assert after
    assert after[0] - resumed_at <= 1.0


def test_a_fair_limit_serves_a_later_tenant_in_turn(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Behind tenant a's 60 waiting tasks at 10/s, tenant b's 10 (sent later) all start
    within about 20 intervals, alternating with a's, and the limit stays fully used."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=LINE) as nodes:
        flood = [capp.fair_line.delay("a", i) for i in range(60)]
        wait_in_line(redis_base, 50, timeout=20)
        sent = time.time()
        later = [capp.fair_line.delay("b", 100 + i) for i in range(10)]
        states = wait_results([*flood, *later], timeout=40)
        rows = read_records(records, expect=70, timeout=2)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 70
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in [*flood, *later])
    b_starts = [r["t"] for r in rows if r["tenant"] == "b"]
    a_during = sum(1 for r in rows if r["tenant"] == "a" and sent <= r["t"] <= max(b_starts))
    times = [r["t"] for r in rows]
    used = (len(times) - 1) / (times[-1] - times[0]) / 10
    print(f"\nfair: tenant b's 10 done {max(b_starts) - sent:.2f}s after they were sent "
          f"(a's 60: {60 / 10:.0f}s of the limit), {a_during} of a's meanwhile; "
          f"limit used {used:.2f}")
    assert max(b_starts) - sent <= 20 * 0.1 + 1.0  # 20 intervals and the trips
    assert a_during >= 5  # alternating, not b first and a stopped
    assert used >= 0.85
    check_window_bound(times, rate=10, burst=1, period=1.0)
    assert " ERROR" not in text


def _started(records: redis.Redis, count: int, timeout: float) -> None:
    """Wait (bounded) until ``count`` starts are recorded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and records.llen("records") < count:
        time.sleep(0.05)
    assert records.llen("records") >= count, f"fewer than {count} starts in {timeout}s"


FAST_WEIGHTS = {"throttle_fair_weights": {"fast_fair": {"a": 3, "b": 2}}}


def test_a_fast_fair_limit_shares_its_backlog_by_weight_and_serves_a_latecomer(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """At 20/s on 8 processes, where each wait could be slept out in a process: tenants a, b
    and c (weights 3:2:1) send 60 tasks each at once, d (weight 1) 10 once 20 have started.
    The backlog is the scheduler's: a, b and c share the starts by weight, and d's 10 are
    done within its share of the limit (1 in 7 starts), not behind the backlog (9 s)."""
    with worker_nodes(redis_base, ("w1", "w2"), conf={**LINE, **FAST_WEIGHTS}) as nodes:
        flood = [capp.fast_fair.delay(t, i) for t in "abc" for i in range(60)]
        _started(records, 20, timeout=30)
        sent = time.time()
        later = [capp.fast_fair.delay("d", 100 + i) for i in range(10)]
        states = wait_results([*flood, *later], timeout=60)
        rows = read_records(records, expect=190, timeout=5)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 190
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in [*flood, *later])
    c_first = next(i for i, r in enumerate(rows) if r["tenant"] == "c")
    shares = Counter(r["tenant"] for r in [r for r in rows[c_first:] if r["tenant"] != "d"][:90])
    d_done = max(r["t"] for r in rows if r["tenant"] == "d") - sent
    times = [r["t"] for r in rows]
    used = (len(times) - 1) / (times[-1] - times[0]) / 20
    print(f"\nfast fair: a/b/c of 90 after c's first start {shares['a']}/{shares['b']}/"
          f"{shares['c']}; d's 10 done {d_done:.2f}s after they were sent; "
          f"limit used {used:.2f}")
    for tenant, share in (("a", 45), ("b", 30), ("c", 15)):
        assert abs(shares[tenant] - share) <= 0.15 * share, shares
    assert d_done <= 70 * 0.05 + 1.5  # its share (70 intervals) and the trips
    assert used >= 0.9
    check_window_bound(times, rate=20, burst=1, period=1.0)
    assert " ERROR" not in text


def test_an_urgent_task_passes_a_fast_limit_s_backlog(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """At 20/s on 8 processes, an urgent task sent behind a flowing batch starts within a
    few intervals, not behind the messages the workers hold (prefetched, sleeping)."""
    with worker_nodes(redis_base, ("w1", "w2"), conf=LINE,
                      env={"CT_LINE_RATE": "20/s"}) as nodes:
        batch = [capp.in_line.apply_async((i,), priority=BATCH) for i in range(120)]
        _started(records, 20, timeout=30)
        sent = time.time()
        urgent = capp.in_line.apply_async((1000,), priority=URGENT)
        states = wait_results([*batch, urgent], timeout=60)
        rows = read_records(records, expect=121, timeout=5)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 121
    start = next(r["t"] for r in rows if r["i"] == 1000)
    after = sum(1 for r in rows if r["i"] != 1000 and r["t"] > start)
    print(f"\nurgent behind a 20/s batch: started {start - sent:.3f}s after it was sent, "
          f"{after} batch tasks after it")
    assert start - sent <= 0.5  # a few intervals (0.05 s) and the trip, not the batch's
    assert after >= 60
    check_window_bound([r["t"] for r in rows], rate=20, burst=1, period=1.0)
    assert " ERROR" not in text


def _woken_late(capp: ModuleType, records: redis.Redis, redis_base: str,
                conf: dict[str, object], asked_again: str) -> tuple[int, str]:
    """80 tasks at 20/s on 2 nodes whose processes stall 0.2 s after every third sleep to a
    start: each runs exactly once, within the window bound.  Returns how many log lines
    say ``asked_again`` (the stalls caught), and the logs."""
    with worker_nodes(redis_base, ("w1", "w2"),
                      conf={**LINE, **conf},
                      env={"CT_STALL": "defer.start_slept:0.2:3"}) as nodes:
        results = [capp.steady.delay(i) for i in range(80)]
        states = wait_results(results, timeout=60)
        rows = read_records(records, expect=80, timeout=5)
        text = logs(nodes)
    assert states == ["SUCCESS"] * 80
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    again = len(re.findall(asked_again, text))
    worst = check_window_bound([r["t"] for r in rows], rate=20, burst=1, period=1.0)
    print(f"\nwoken late every third sleep: {again} times asked again, worst windows {worst}")
    assert " ERROR" not in text
    return again, text


def test_a_task_woken_late_for_its_turn_waits_again_in_line(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Every third turn a process wakes 0.2 s late (4 intervals at 20/s): those tasks wait in
    line again instead of starting late, so the starts keep the window bound."""
    # Eight processes hold 0.4 s of the backlog: sleeps of at most 0.1 s put the
    # rest in line.
    again, _ = _woken_late(capp, records, redis_base, {"throttle_max_sleep": 0.1},
                           r"after its turn; in line again")
    assert again >= 5  # the stalls happened, and were caught


def test_a_task_woken_late_for_its_booked_start_asks_again(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """Short waits are booked and slept (each wait here is under 0.4 s: 8 processes at
    20/s, within a dispatch's reach of 0.5 s); every third process wakes 0.2 s late for
    the booked start it was admitted for: it asks again (that start is lost) instead of starting
    late, so the starts keep the window bound."""
    # A wait within the dispatch's reach (its lead plus the trip) is booked: a lead of
    # 0.5 s (the most it reaches) books every wait here.
    again, text = _woken_late(capp, records, redis_base,
                              {"throttle_max_sleep": 5.0, "throttle_dispatch_lead": 0.5},
                              r"after its booked start; asking again")
    assert again >= 5  # the stalls happened, and were caught
    # No wait was long enough to go in line: a task waits in line here only once it has
    # lost the booked starts a process may sleep for (a loaded machine wakes a process
    # later than the grace, 25 ms at 20/s, without a stall), and never on its first ask.
    lost = Counter(re.findall(r"\[([0-9a-f-]+)\] ready [0-9.]+s after its booked start", text))
    lined = re.findall(r"\[([0-9a-f-]+)\] waits in line for limit", text)
    print(f"waited in line (each after losing its booked starts): {len(lined)}")
    assert all(lost[task_id] >= _MAX_SLEEPS for task_id in lined), (lined, lost)
