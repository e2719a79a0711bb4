"""Real worker processes on a real Redis: the window bound, throughput, exactly-once, semantics.

Judged only from the start times the tasks record and from the result backend.
"""

from __future__ import annotations

import time
from collections import Counter
from types import ModuleType

import pytest
import redis

from ..servers import until
from ..workers import COUNTDOWNS, check_window_bound, logs, read_records, wait_results, worker_nodes

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("max_sleep", "min_share", "max_deferrals", "broker"),
    [
        # The default (0.5 s): the targets (>= 90 % of the rate, <= 1.1
        # deferrals per task); near booked starts are slept for, then claimed.
        (None, 0.9, 1.1, "redis"),
        # Most waits re-published with a countdown (throttle_waiting_room
        # off): a check of the deferral path, not of the targets.  Booked starts lost
        # while the workers take in the backlog (a claim more than 25 ms late
        # at 20/s is void) cost 3-12 % and up to 0.1 extra deferrals per task
        # on 2026-11-30 (17.6-19.3/s,
        # 1.00-1.105 over 16 runs); on 2026-12-01, with the same code on this
        # machine (celery 5.7.0, kombu 5.7.0, redis-py 8.1.0), 15.7-16.7/s
        # and 1.17-1.25 over 5 runs, hence the wider margins.  On 2026-12-07, amqp:
        # 17.8/s alone (2 runs), 13.5/s in a full suite beside another test's worker
        # nodes (-n 2 on 2 cores): the floor guards the path against a gross loss.
        ("0.25-countdown", 0.6, 1.35, "redis"),
        ("0.25-countdown", 0.6, 1.35, "amqp"),
        # The same waits parked in the waiting room (the default) and dispatched
        # just in time (measured 18.7 and 19.1/s, 9 and 14 booked starts lost during
        # intake).
        ("0.25", 0.9, 1.1, "redis"),
        # The same on a real RabbitMQ: dispatched tasks go by the lanes there too.
        ("0.25", 0.9, 1.1, "amqp"),
    ],
    indirect=["broker"],
)
def test_backlog_two_prefork_nodes_keeps_bound_and_rate(
    capp: ModuleType, records: redis.Redis, redis_base: str, max_sleep: str | None,
    min_share: float, max_deferrals: float, broker: str,
) -> None:
    """200 tasks at 20/s on two prefork nodes: bound held, rate kept, each run once, SUCCESS."""
    conf: dict[str, object] = ({"throttle_max_sleep": float(max_sleep.removesuffix("-countdown"))}
                               if max_sleep else {})
    if max_sleep and max_sleep.endswith("-countdown"):
        conf.update(COUNTDOWNS)
    elif broker == "amqp":
        # The test store keeps nothing on disk and is not RabbitMQ's server: by
        # default its waits would take the countdown path (room/durability.py).
        conf["throttle_waiting_room"] = "always"
    with worker_nodes(redis_base, ("w1", "w2"), conf=conf) as nodes:
        results = [capp.steady.delay(i) for i in range(200)]
        rows = read_records(records, expect=200, timeout=60)
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    times = [r["t"] for r in rows]
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    assert states == ["SUCCESS"] * 200
    worst = check_window_bound(times, rate=20, burst=1, period=1.0)
    throughput = (len(times) - 1) / (times[-1] - times[0])
    deferrals = sum(r["deferrals"] for r in rows) / len(rows)
    # Lateness of starts in a booked start (none when every wait was slept in-process).
    late = sorted(r["t"] - r["slot"] / 1e6 for r in rows if r["slot"]) or [float("nan")]
    print(f"\nbacklog ({broker}, max_sleep {max_sleep or 'default'}): "
          f"throughput {throughput:.2f}/s of 20/s, worst windows {worst}, "
          f"deferrals/task {deferrals:.2f}, start lateness p50 {late[len(late) // 2]:.4f}s "
          f"max {late[-1]:.4f}s")
    assert throughput >= min_share * 20
    assert deferrals <= max_deferrals
    assert {r["host"].split("@")[0] for r in rows} == {"w1", "w2"}
    assert "limits in force" in text
    assert " ERROR" not in text


def test_per_key_buckets_are_independent(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """A tenant flooding its key does not delay another tenant on the same queue."""
    with worker_nodes(redis_base, ("w1",)):
        flood = [capp.per_tenant.delay("big", i) for i in range(40)]  # 8 s of work at 5/s
        read_records(records, expect=2, timeout=10)  # the flood is under way
        t_sent = time.time()
        quiet = [capp.per_tenant.delay("small", i) for i in range(3)]
        wait_results(quiet, timeout=20)
        rows = read_records(records, expect=43, timeout=20)
        wait_results(flood, timeout=20)
    small = [r["t"] for r in rows if r["tenant"] == "small"]
    big = [r["t"] for r in rows if r["tenant"] == "big"]
    assert len(small) == 3
    # The quiet tenant's 3 starts need 2 intervals of its own bucket, not the flood's 8 s.
    assert max(small) - t_sent < 2 * 0.2 + 1.0
    check_window_bound(big, rate=5, burst=1, period=1.0)
    check_window_bound(small, rate=5, burst=1, period=1.0)


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_queue_limit_applies_to_undecorated_task(
    capp: ModuleType, records: redis.Redis, redis_base: str, broker: str
) -> None:
    """An undecorated task consumed from the 'ext' queue (10/s) keeps the queue's limit."""
    with worker_nodes(redis_base, ("w1", "w2")):
        results = [capp.undecorated.apply_async((i,), queue="ext") for i in range(40)]
        rows = read_records(records, expect=40, timeout=30)
        assert wait_results(results, timeout=20) == ["SUCCESS"] * 40
    times = [r["t"] for r in rows]
    check_window_bound(times, rate=10, burst=1, period=1.0)
    # The queue's limit is used (not, say, half of it).  How nearly is the benchmarks'
    # to judge: a full suite on 2 cores measured 8.88/s, the first wait's dispatch 0.59 s
    # late (0.13-0.30 s alone).
    assert (len(times) - 1) / (times[-1] - times[0]) >= 0.8 * 10
    assert {r["queue"] for r in rows} == {"ext"}  # deferred copies went back to their queue
    assert max(r["deferrals"] for r in rows) >= 1


def test_stacked_limit_waiting_does_not_consume_sibling_limit(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """A task held by its own 2/s limit leaves the shared 10/s limit to its sibling."""
    with worker_nodes(redis_base, ("w1", "w2")):
        held = [capp.held_by_own.delay(i) for i in range(10)]  # ~5 s at its own 2/s
        sib = [capp.sibling.delay(i) for i in range(40)]
        rows = read_records(records, expect=50, timeout=40)
        wait_results(held + sib, timeout=20)
    shared = [r["t"] for r in rows]  # both tasks pass the shared limit
    check_window_bound(shared, rate=10, burst=1, period=1.0)
    held_t = [r["t"] for r in rows if r["task"].endswith("held_by_own")]
    check_window_bound(held_t, rate=2, burst=1, period=1.0)
    # While the siblings run, the shared limit is used at its full rate: held
    # tasks waiting for their own limit do not block it.
    sib_t = [r["t"] for r in rows if r["task"].endswith("sibling")]
    in_span = [t for t in shared if sib_t[0] <= t <= sib_t[-1]]
    assert (len(in_span) - 1) / (sib_t[-1] - sib_t[0]) >= 0.9 * 10


def test_retry_budget_untouched_and_expiry_honoured(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """max_retries=0 tasks deferred many times succeed with retries 0; expired ones never run;
    a task past its max_wait fails with ThrottleTimeout, logged as expected (no traceback)."""
    with worker_nodes(redis_base, ("w1",)) as nodes:
        plain = [capp.no_retries.delay(i) for i in range(15)]  # up to ~3 s of waiting
        expiring = [capp.expiring.apply_async((i,), expires=2.0) for i in range(12)]
        impatient = [capp.impatient.delay(i) for i in range(5)]
        sent = time.time()
        states = wait_results(plain + expiring, timeout=30)
        late = wait_results(impatient, timeout=10)
        until("each timeout is logged",
              lambda: logs(nodes).count("raised expected") >= late.count("FAILURE"), 10)
        rows = read_records(records, expect=0, timeout=0)
        log = logs(nodes)
    assert states[:15] == ["SUCCESS"] * 15
    assert {r["retries"] for r in rows if r["task"].endswith("no_retries")} == {0}
    assert max(r["deferrals"] for r in rows if r["task"].endswith("no_retries")) >= 1
    ran = [r for r in rows if r["task"].endswith("expiring")]
    assert all(r["t"] <= sent + 2.0 + 0.05 for r in ran)
    assert 3 <= len(ran) <= 6  # 2/s for 2 s, plus the burst at t=0
    assert states[15:].count("REVOKED") == 12 - len(ran)
    # max_wait=1.5 at 1/s: starts at 0, 1 and 2 s pass (waits <= 1.5 s after the first
    # deferral is not required); the rest fail with ThrottleTimeout, none run late.
    assert late.count("SUCCESS") + late.count("FAILURE") == 5
    assert 2 <= late.count("SUCCESS") <= 3
    failed = [r for r in impatient if r.state == "FAILURE"]
    assert all(type(r.result).__name__ == "ThrottleTimeout" for r in failed)
    assert log.count("raised expected: ThrottleTimeout") == len(failed)
    assert "raised unexpected" not in log
    assert len([r for r in rows if r["task"].endswith("impatient")]) == late.count("SUCCESS")


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_other_pools(capp: ModuleType, records: redis.Redis, redis_base: str, pool: str) -> None:
    """The threads and solo pools gate the same way (stacked limits with a token cost)."""
    with worker_nodes(redis_base, ("w1",), pool=pool, concurrency=4):
        prompts = ["x" * (40 * (i % 4 + 1)) for i in range(30)]
        results = [capp.summarize.delay(p) for p in prompts]
        rows = read_records(records, expect=30, timeout=40)
        assert wait_results(results, timeout=20) == ["SUCCESS"] * 30
    check_window_bound([r["t"] for r in rows], rate=10, burst=1, period=1.0)


def test_shared_task_is_gated(capp: ModuleType, records: redis.Redis, redis_base: str) -> None:
    """A @shared_task under @throttled keeps its limit in the worker."""
    with worker_nodes(redis_base, ("w1",)):
        # Sent by the test app: the shared proxy sends through the current app, which
        # another test in this process may have made its own.
        shared_one = capp.app.tasks[capp.shared_one.name]
        results = [shared_one.delay(i) for i in range(20)]
        rows = read_records(records, expect=20, timeout=30)
        assert wait_results(results, timeout=20) == ["SUCCESS"] * 20
    check_window_bound([r["t"] for r in rows], rate=10, burst=1, period=1.0)


def test_user_retry_does_not_reuse_a_spent_booked_start(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """A task that retries right after starting in its booked start passes the gate again."""
    with worker_nodes(redis_base, ("w1", "w2")):
        results = [capp.retry_once.delay(i) for i in range(20)]
        rows = read_records(records, expect=40, timeout=40)
        assert wait_results(results, timeout=20) == ["SUCCESS"] * 20
    assert len(rows) == 40  # each task: one start, one retry
    check_window_bound([r["t"] for r in rows], rate=5, burst=1, period=1.0)


def test_long_waits_hop_within_max_countdown(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """With a 1 s max countdown, 4 s waits take several hops and keep the bound (countdown path)."""
    with worker_nodes(redis_base, ("w1",), conf={"throttle_max_countdown": 1, **COUNTDOWNS}):
        results = [capp.long_wait.delay(i) for i in range(3)]  # starts at 0, 2 and 4 s
        assert wait_results(results, timeout=30) == ["SUCCESS"] * 3
        rows = read_records(records, expect=3, timeout=5)
    times = [r["t"] for r in rows]
    check_window_bound(times, rate=0.5, burst=1, period=2.0)
    assert max(r["deferrals"] for r in rows) >= 4  # the 4 s wait: at least 4 hops of <= 1 s


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_deferrals_leave_no_garbage_behind(capp: ModuleType, records: redis.Redis,
                                           redis_base: str, freeze: str) -> None:
    """Each deferral's ``Ignore`` leaves two ExceptionInfo copies as cyclic garbage.

    With ``throttle_gc_freeze`` (the default) the next run collects them, so
    a pool process holds none after 80 deferrals; without it (the negative
    control) they wait for the collector's rare full passes, dozens at a
    time (``celery_throttle/memory.py`` has the measured cost of that).
    """
    with worker_nodes(redis_base, ("w1",), concurrency=2,
                 conf={"throttle_max_sleep": 0, "throttle_gc_freeze": freeze == "1"}):
        # With an ETA (due at once) the pool's gate decides each, not the node's look on
        # arrival, so the deferrals are made in the pool processes whose garbage is read.
        results = [capp.steady.apply_async((i,), countdown=0.001) for i in range(40)]
        assert wait_results(results, timeout=30) == ["SUCCESS"] * 40
        reports = [capp.garbage_report.delay().get(timeout=10) for _ in range(8)]
    rows = read_records(records, expect=40, timeout=1)
    deferrals = sum(r["deferrals"] for r in rows)
    assert deferrals >= 30  # at 20/s nearly every task waited outside the worker
    held = max(r["held"] for r in reports)
    if freeze == "1":
        assert min(r["frozen"] for r in reports) > 10_000
        assert held <= 2, reports
    else:
        assert max(r["frozen"] for r in reports) == 0
        assert held > 4, reports  # the garbage the collector has not reached yet


def test_worker_warns_when_the_app_was_never_installed(redis_base: str) -> None:
    """@throttled tasks, no install(app): one WARNING at start saying what is missing."""
    with worker_nodes(redis_base, ("w1",), concurrency=1, env={"CT_NO_INSTALL": "1"}) as nodes:
        text = logs(nodes)
    assert "celery_throttle.install(app) was never called" in text
    assert "queue limits (throttle_queues)" in text
    assert "limits in force" not in text  # install's own start line is missing, as said
