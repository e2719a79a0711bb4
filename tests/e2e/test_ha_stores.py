"""Workers on a Sentinel or Cluster store: a real failover and a real resharding mid-backlog
(tests/servers.py starts and stops the servers)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from types import ModuleType

import pytest
import redis

from celery_throttle import Gate, Limit, parse_rate
from celery_throttle.core.connect import connect
from celery_throttle.core.keys import bucket_key

from ..servers import MASTER, Cluster, SentinelGroup, key_slot
from ..workers import (
    ROOT,
    app_env,
    check_window_bound,
    logs,
    read_records,
    wait_results,
    worker_nodes,
)

pytestmark = pytest.mark.integration


def test_workers_on_a_cluster_store_survive_a_resharding_and_status_reads_it(
    capp: ModuleType, records: redis.Redis, redis_base: str, redis_cluster: Cluster,
    prefix: str,
) -> None:
    """Two worker nodes whose store is the cluster: the prefix's slot moves mid-backlog, every
    task runs once at the bound, and `celery throttle status` reads the cluster."""
    conf = {"throttle_redis_url": redis_cluster.url}
    env = {"CT_PREFIX": prefix}
    with worker_nodes(redis_base, ("w1", "w2"), conf=conf, env=env) as nodes:
        results = [capp.steady.delay(i) for i in range(60)]
        read_records(records, expect=20, timeout=30)
        with contextlib.closing(redis_cluster.client(0)) as cli:
            slot = key_slot(cli, bucket_key(prefix, "x"))
        moved = redis_cluster.move_slot(slot, (redis_cluster.owner(slot) + 1) % 3)
        rows = read_records(records, expect=60, timeout=60)
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    assert moved >= 1
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    assert states == ["SUCCESS"] * 60
    worst = check_window_bound([r["t"] for r in rows], rate=20, burst=1, period=1.0)
    assert " ERROR" not in text
    status = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.celery_app", "throttle", "status",
         "tests.celery_app.steady"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, **app_env(redis_base, conf), **env})
    assert status.returncode == 0, status.stderr
    row = next(line for line in status.stdout.splitlines() if "celery_app.steady" in line)
    assert "20/s" in row
    assert "waiting room: 0 parked" in status.stdout
    print(f"\ncluster store: {moved} keys moved mid-run, worst windows {worst}")


def _replication_lag(group: SentinelGroup) -> int:
    """Bytes of the master's replication stream the replica had not acknowledged (racy by
    nature: a moment's reading, just before the kill)."""
    with redis.Redis(port=group.master.port) as master, \
            redis.Redis(port=group.replica.port) as replica:
        sent = int(master.info("replication")["master_repl_offset"])
        got = int(replica.info("replication")["slave_repl_offset"])
    return max(0, sent - got)


class _Probe(threading.Thread):
    """Decides every 20 ms on a limit of its own; records when decisions failed."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.gate = Gate(connect(url, master_name=MASTER, socket_timeout=1,
                                 socket_connect_timeout=1), prefix=prefix)
        self.failures: list[float] = []
        self.successes: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        lim = Limit("probe", parse_rate("1000/s"), 1000)
        deadline = time.monotonic() + 120  # bounded, whatever the test does
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.gate.acquire_many([lim])
                self.successes.append(time.monotonic())
            except redis.RedisError:
                self.failures.append(time.monotonic())
            time.sleep(0.02)


def test_sentinel_failover_mid_backlog_loses_and_repeats_nothing(
    capp: ModuleType, records: redis.Redis, redis_base: str, prefix: str,
) -> None:
    """Two worker nodes whose store is a Sentinel master: SIGKILL the master mid-backlog; the
    sentinels promote the replica, the workers follow it without a restart, every task runs
    exactly once, and the window bound holds (one extra burst allowed: see the guarantees)."""
    with SentinelGroup() as group:
        # Waits over 50 ms are parked: the waiting room (and its WAIT for the
        # replica) is in play on both sides of the failover.
        conf = {"throttle_redis_url": group.url, "throttle_sentinel_master": MASTER,
                "throttle_max_sleep": 0.05}
        probe = _Probe(group.url, prefix)
        probe.start()
        try:
            with worker_nodes(redis_base, ("w1", "w2"), conf=conf,
                              env={"CT_PREFIX": prefix}) as nodes:
                results = [capp.steady.delay(i) for i in range(80)]
                read_records(records, expect=25, timeout=30)
                behind = _replication_lag(group)
                killed = time.monotonic()
                group.master.kill()
                rows = read_records(records, expect=80, timeout=90)
                states = wait_results(results, timeout=30)
                text = logs(nodes)
        finally:
            probe.stop.set()
            probe.join(5)
        promoted = group.master_port() == group.replica.port
    assert promoted
    after = [t for t in probe.failures if t >= killed]
    back = min((t for t in probe.successes if t > killed), default=float("inf"))
    assert back - killed < 15, "decisions did not resume on the promoted replica"
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    assert states == ["SUCCESS"] * 80
    times = [r["t"] for r in rows]
    # One burst more than the bound: a bucket write not yet replicated is lost with the master.
    worst = check_window_bound(times, rate=20, burst=2, period=1.0)
    assert " ERROR" not in text
    outage = text.count("store unavailable (deferral")  # the "defer" policy at work
    print(f"\nsentinel failover: decisions failed for {back - killed:.2f}s after SIGKILL "
          f"({len(after)} probe failures), worst windows {worst}, "
          f"{outage} deferrals for the outage, replica {behind} bytes behind at the kill, "
          f"{text.count(', parked)')} parks in all, "
          f"{text.count('reached 0 of 1 replicas')} park warnings (no replica left)")
