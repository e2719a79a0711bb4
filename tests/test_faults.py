"""Breaking things on purpose: the throttle's own Redis dies in the middle of a run."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis

from celery_throttle.testing import RedisServer

from .workers import check_window_bound, cluster, logs, read_records, wait_results

pytestmark = pytest.mark.integration


@pytest.fixture
def store() -> Iterator[RedisServer]:
    """A throttle store on its own server, separate from the broker, that the test can kill."""
    server = RedisServer().start()
    yield server
    server.stop()


def test_store_killed_mid_run_defers_then_completes_exactly_once(
    capp: ModuleType, records: redis.Redis, redis_base: str, store: RedisServer
) -> None:
    """Store SIGKILLed for 3 s under on_error='defer': no start while down, all run once after."""
    with cluster(redis_base, ("w1", "w2"), env={"CT_STORE": f"{store.url}/0"}):
        results = [capp.steady.delay(i) for i in range(100)]  # 5 s of work at 20/s
        time.sleep(1.5)
        store.kill()
        killed = time.time()
        time.sleep(3.0)
        restarted = time.time()
        store.start()
        states = wait_results(results, timeout=60)
        rows = read_records(records, expect=100, timeout=10)
    assert states == ["SUCCESS"] * 100
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)  # exactly once
    # Starts during the outage: only tasks that had passed the gate and were
    # sleeping up to throttle_max_sleep (0.5 s) for their booked slot.
    during = [r["t"] for r in rows if killed + 0.55 < r["t"] < restarted]
    assert during == []
    after = [r["t"] for r in rows if r["t"] >= restarted]
    assert after, "nothing ran after the restart"
    # The store came back empty: at most one extra burst (B = 1) on top of the bound.
    check_window_bound(after, rate=20, burst=2, period=1.0)


def test_script_flush_mid_run_fails_nothing(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """SCRIPT FLUSH three times during a run: every task succeeds once, the bound holds."""
    store = redis.Redis.from_url(f"{redis_base}/11")
    with cluster(redis_base, ("w1", "w2")):
        results = [capp.steady.delay(i) for i in range(60)]  # 3 s at 20/s
        for _ in range(3):
            time.sleep(0.7)
            store.script_flush()
        states = wait_results(results, timeout=30)
        rows = read_records(records, expect=60, timeout=10)
    store.close()
    assert states == ["SUCCESS"] * 60
    assert Counter(r["id"] for r in rows) == Counter(r.id for r in results)
    check_window_bound([r["t"] for r in rows], rate=20, burst=1, period=1.0)


@pytest.mark.parametrize("policy", ["allow", "fail"])
def test_store_down_policies_in_real_workers(
    capp: ModuleType, records: redis.Redis, redis_base: str, store: RedisServer, policy: str
) -> None:
    """Store unreachable: 'allow' runs every task with a WARNING, 'fail' fails each visibly."""
    store.kill()
    url = f"redis://:hunter2@127.0.0.1:{store.port}/0"  # a password that must not leak
    with cluster(redis_base, ("w1",), env={"CT_STORE": url, "CT_ON_ERROR": policy}) as nodes:
        results = [capp.steady.delay(i) for i in range(10)]
        states = wait_results(results, timeout=30)
        text = logs(nodes)
    assert "store unavailable" in text
    assert "hunter2" not in text
    if policy == "allow":
        assert states == ["SUCCESS"] * 10
        assert " WARNING" in text or "WARNING/" in text
    else:
        assert states == ["FAILURE"] * 10
        assert {type(r.result).__name__ for r in results} == {"ThrottleStoreError"}
        assert records.llen("records") == 0  # no task body ran
