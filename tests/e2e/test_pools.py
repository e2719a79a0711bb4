"""The threads, gevent and eventlet pools (one node, 50 threads, tasks that do I/O), and
prefork with its processes recycled."""

from __future__ import annotations

import re
import time
from collections import Counter
from types import ModuleType

import pytest
import redis

from celery_throttle.integration.arrival import EMPTY_FOR_S

from ..workers import check_window_bound, logs, read_records, wait_results, worker_nodes

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_one_process_pools_keep_the_bound_and_use_the_limit(
    capp: ModuleType, records: redis.Redis, redis_base: str, pool: str
) -> None:
    """100 tasks of 0.2 s of I/O at 20/s on ``-P <pool> -c 50``: each runs once, the window
    bound holds, and the limit is used (most of them wait in line; the dispatcher keeps
    their time from a thread of its own, outside the pool's event loop)."""
    with worker_nodes(redis_base, ("w1",), pool=pool, concurrency=50) as nodes:
        results = [capp.io_call.delay(i) for i in range(100)]
        rows = read_records(records, expect=100, timeout=60)
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    times = [r["t"] for r in rows]
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # each once
    assert states == ["SUCCESS"] * 100
    # The starts the throttle gave, on the store's clock (a copy dispatched from its line
    # carries its start): the window bound, exactly.
    given = [r["slot"] / 1e6 for r in rows if r.get("slot")]
    assert len(given) >= 50
    check_window_bound(given, rate=20, burst=1, period=1.0)
    # What a provider would see, each run's first line: a thread scheduled late after its
    # start adds to that (in a full suite, two test workers on 2 cores, one run's first
    # line came about 50 ms after its start: 7 in a 0.25 s window): one start more allowed.
    worst = check_window_bound(times, rate=20, burst=2, period=1.0)
    used = (len(times) - 1) / (times[-1] - times[0]) / 20
    in_line = sum(1 for r in rows if r["deferrals"])
    print(f"\n{pool}: limit used {used:.3f}, worst windows {worst}, {in_line} waited in line")
    # The benchmark (benchmarks/pools.py) measures the use over 10 runs: 0.95 and more.
    # Here a floor with room for a loaded CI machine: before the dispatcher had a
    # thread of its own this run measured 0.89-0.94.
    assert used >= 0.85
    assert in_line >= 50  # the waiting room was in use, not only sleeps
    assert " ERROR" not in text
    assert "Traceback" not in text


def test_recycled_processes_keep_the_bound_and_tasks_wait_in_line_without_a_pool_run(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """``worker_max_tasks_per_child=3`` on two prefork nodes, 60 tasks at 10/s: each runs
    once and the bound holds.  The 40 sent once the limit has a line join it in the nodes'
    main processes, without a pool run, and each node replaces an exited process within
    0.25 s
    (``throttle_pool_check_interval``'s default)."""
    from celery_throttle.integration.runtime import runtime_for

    line = runtime_for(capp.app).room.lines
    with worker_nodes(redis_base, ("w1", "w2"), conf={"worker_max_tasks_per_child": 3},
                      env={"CT_LINE_RATE": "10/s"}) as nodes:
        first = [capp.in_line.delay(i) for i in range(20)]
        # Until the line has stood longer than a main process remembers a look that found
        # it empty (EMPTY_FOR_S): a task arriving within that memory goes to the pool, whose
        # gate lines it up there, as documented.
        deadline, since = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            if not line.next_in_line(1, "line"):
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since > 2 * EMPTY_FOR_S:
                break
            time.sleep(0.01)
        assert since is not None, "no task of the first 20 waited in line"
        later = [capp.in_line.delay(i) for i in range(20, 60)]
        results = first + later
        rows = read_records(records, expect=60, timeout=60)
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    times = [r["t"] for r in rows]
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # each once
    assert states == ["SUCCESS"] * 60
    check_window_bound(times, rate=10, burst=1, period=1.0)
    # Where each later task first waited (the earliest line of any node's log): a main
    # process, as it arrived behind the line.
    waits = sorted(re.findall(r"^\[([\d:, -]+): INFO/([\w-]+)\] throttle: task \S+\[([0-9a-f-]+)"
                              r"\] waits in line", text, re.M))
    where: dict[str, str] = {}
    for _, process, task_id in waits:
        where.setdefault(task_id, process)
    used = (len(times) - 1) / (times[-1] - times[0]) / 10
    print(f"\nrecycled: limit used {used:.3f}, "
          f"{sum(1 for p in where.values() if p == 'MainProcess')} of {len(where)} tasks first "
          f"waited in a main process, {len({r['pid'] for r in rows})} pool processes ran one")
    assert [where.get(r.id) for r in later] == ["MainProcess"] * 40
    # Each node checks for exited processes itself too, not only at Celery's 5 s timer.
    assert text.count("pool processes are recycled: replaced within 0.250s of their exit") == 2
    assert " ERROR" not in text
    assert "Traceback" not in text
