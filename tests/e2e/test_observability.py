"""What an operator sees of live workers: `celery throttle` status/why/reset and the
Prometheus endpoint."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
import redis

from celery_throttle import Gate, Limit, parse_rate
from celery_throttle.testing import free_port

from .. import databases
from ..servers import until
from ..workers import read_records, throttle_cli, wait_results, worker_nodes

pytestmark = pytest.mark.integration


def test_command_answers_why_a_task_waits_and_until_when(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """`celery throttle status/why/reset` against live workers and Redis (countdowns, whose
    starts are booked at arrival: the lines' status and why are tests/e2e/test_scheduler.py's)."""
    with worker_nodes(redis_base, ("w1",), conf={"throttle_waiting_room": False}):
        results = [capp.patient.delay(i) for i in range(20)]  # 1/s: a 19 s queue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and records.llen("records") < 2:
            time.sleep(0.1)
        # Every task still to come has been told to wait, its start booked.
        until("the waiting tasks are booked",
              lambda: all(r.state == "THROTTLED" for r in results[5:]), 20)
        status = throttle_cli(["status", "--json", "patient"], redis_base)
        table = throttle_cli(["status"], redis_base)
        why = throttle_cli(["why", results[15].id], redis_base)
        why_json = throttle_cli(["why", "--json", results[15].id], redis_base)
        keyed = throttle_cli(["status", "tests.celery_app.per_tenant", "--key", "acme"], redis_base)
        reset = throttle_cli(["reset", "patient"], redis_base)
        unknown = throttle_cli(["status", "nope"], redis_base)
    for done in (status, table, why, why_json, keyed, reset):
        assert done.returncode == 0, done.stderr
    (row,) = json.loads(status.stdout)["limits"]
    assert row["limit"] == "patient"
    assert row["rate"] == "1/s"
    assert 14 <= row["booked_ahead"] <= 19  # the tasks still waiting hold their bookings
    assert 14 <= row["next_free_s"] <= 19
    assert re.search(r"^patient\s+1/s\s+1\s+100%\s+in \d+\.\d{3}s\s+1\d\s+"
                     r"tests.celery_app.patient$", table.stdout, flags=re.MULTILINE), table.stdout
    assert re.search(r"^tests.celery_app.per_tenant \(per key\) .* per key: name one with --key",
                     table.stdout, flags=re.MULTILINE), table.stdout
    assert re.search(rf"^task {results[15].id} \(tests\.celery_app\.patient\) waits for "
                     r"limit 'patient': next start in \d+\.\d{3}s; deferral \d+, .*; start booked$",
                     why.stdout, flags=re.MULTILINE), why.stdout
    wait = json.loads(why_json.stdout)["waiting"]
    # The 16th task sent starts about 15 s after the first start.  Judged on the
    # note's absolute due time (server clock, the records' clock on this host):
    # the relative due_in_s shrinks with every second the commands before it
    # took to start up (seen on a loaded CI box: 9.2 s left for a bound of 10).
    first = min(float(json.loads(r)["t"]) for r in records.lrange("records", 0, -1))
    assert 12 <= wait["due"] / 1e6 - first <= 18
    assert wait["booked"] is True
    assert "per_tenant (per key)  5/s" in keyed.stdout
    assert "bucket reset" in reset.stdout
    assert unknown.returncode == 2
    assert "unknown limit 'nope'" in unknown.stderr


def test_prometheus_endpoint_counts_a_prefork_run(
    capp: ModuleType, records: redis.Redis, redis_base: str, tmp_path: Path
) -> None:
    """A prefork node in multiprocess mode: /metrics adds up every child's counts."""
    port = free_port()
    conf = {"throttle_metrics_port": port,
            "throttle_max_sleep": 0.05}  # waits are re-published: deferrals to count
    steady = Limit("tests.celery_app.steady", parse_rate("20/s"))
    gate = Gate.from_url(f"{redis_base}/{databases.STORE}")  # the test app's store, default prefix
    with worker_nodes(redis_base, ("w1",), conf=conf,
                      env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}), gate:
        results = [capp.steady.delay(i) for i in range(40)]  # 2 s at 20/s
        assert wait_results(results, timeout=30) == ["SUCCESS"] * 40
        rows = read_records(records, expect=40, timeout=5)
        # A known state for the gauges: 20 starts booked ahead (1 s at 20/s).
        booked_at = time.monotonic()
        for _ in range(20):
            gate.acquire_many([steady], reserve=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        scraped_in = time.monotonic() - booked_at
    label = 'limit="tests.celery_app.steady"'

    def value(metric: str) -> float:
        found = re.search(rf"^{metric}\{{{label}\}} (\S+)$", text, flags=re.MULTILINE)
        assert found, f"{metric} missing:\n{text[:3000]}"
        return float(found.group(1))

    assert value("celery_throttle_admitted_total") == 40
    assert value("celery_throttle_deferred_total") == sum(r["deferrals"] for r in rows) > 0
    assert value("celery_throttle_wait_seconds_count") == value("celery_throttle_deferred_total")
    # 20 starts booked, at most one more left by the run (burst 1), drained at 20/s
    # while the scrape went on.
    assert 19 - 20 * scraped_in <= value("celery_throttle_fill_ratio") <= 21
    assert 18 - 20 * scraped_in <= value("celery_throttle_booked_ahead") <= 20
    assert 0.9 - scraped_in <= value("celery_throttle_next_free_seconds") <= 1.05



def _counted(redis_base: str, field: str) -> int:
    """``field`` (``<count>:<limit>``) summed over the seconds the workers have counted."""
    store = redis.Redis.from_url(f"{redis_base}/{databases.STORE}")  # the test app's store
    try:
        return sum(int(store.hget(key, field) or 0)
                   for key in store.scan_iter("{throttle}:counts:*"))
    finally:
        store.close()


def test_a_limit_in_shadow_mode_runs_a_burst_at_once_and_reports_what_it_would_have_done(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """5/s, burst 5, enforce=False, 100 tasks on two nodes: all run within a few seconds
    (enforced: 19 s), and `status` reports the would-have deferrals and drain time."""
    with worker_nodes(redis_base):
        sent = time.time()
        results = [capp.trial.delay(i) for i in range(100)]
        assert wait_results(results, timeout=60) == ["SUCCESS"] * 100
        # Each worker process adds its counts to the store within a second.
        until("every start is counted", lambda: _counted(redis_base, "admitted:trial") >= 100,
              10)
        asked = time.time()
        status = throttle_cli(["status", "--json", "trial"], redis_base)
        answered = time.time()
        table = throttle_cli(["status", "trial"], redis_base)
    starts = [json.loads(r)["t"] for r in records.lrange("records", 0, -1)]
    span = max(starts) - min(starts)
    assert len(starts) == 100
    assert span < 8, span  # enforced, the last would start 19 s after the first
    (row,) = json.loads(status.stdout)["limits"]
    assert (row["enforced"], row["enforced_by"]) == (False, "code")
    would = row["shadow"]["would_defer_15m"]
    print(f"\nshadow 5/s burst 5: 100 tasks started within {span:.2f}s; would have deferred "
          f"{would}, would drain in {row['shadow'].get('would_next_free_s')}s")
    # 95 if every task arrived at once; the bucket refills 5 per second of the burst.
    assert 95 - 5 * (span + 1) <= would <= 95, (would, span)
    assert row["shadow"]["would_wait_s_15m"] > 0
    # The last would-be start, from the moment `status` read it (between asked and answered;
    # not after the nodes stopped, which takes seconds of its own on a loaded machine).
    last_slot = sent + 0.2 * (would + 1)
    next_free = row["shadow"]["would_next_free_s"]
    assert last_slot - answered - 3 <= next_free <= last_slot - asked + 3 + span, row
    assert row.get("booked_ahead", 0) == 0  # the real bucket never held a task back
    assert re.search(r"^trial \(shadow\)\s+5/s\s+5\s+\S+\s+\S+\s+none \(shadow: would have "
                     rf"deferred {would} in 15m", table.stdout, flags=re.MULTILINE), table.stdout
