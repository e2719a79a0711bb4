"""The per-second counts the workers keep in the store for the dashboard's charts."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_throttle import metrics
from celery_throttle.core.keys import counts_key
from celery_throttle.integration.history import KEPT, CountsWriter, read_counts
from celery_throttle.testing import free_port


@pytest.fixture(autouse=True)
def _seconds() -> Iterator[None]:
    metrics.keep_seconds(True)
    metrics.reset()
    yield
    metrics.keep_seconds(False)
    metrics.reset()


def test_counts_are_kept_per_second_only_once_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts go to the second they happen in; take_seconds empties them; off, none are kept."""
    now = [1_000.2]
    monkeypatch.setattr(metrics, "_wall", lambda: now[0])
    metrics.admitted(["a", "b"])
    metrics.deferred("a", 2.5)
    now[0] = 1_001.7
    metrics.provider_paused(["a"])
    assert metrics.take_seconds() == {
        1000: {("admitted", "a"): 1, ("admitted", "b"): 1, ("wait_seconds_sum", "a"): 2.5,
               ("deferred", "a"): 1},
        1001: {("provider_pauses", "a"): 1}}
    assert metrics.take_seconds() == {}
    metrics.keep_seconds(False)
    metrics.admitted(["a"])
    assert metrics.take_seconds() == {}
    assert metrics.snapshot()["a"]["admitted"] == 2  # the process's totals count on


def test_a_forked_process_starts_with_none_of_its_parents_counts() -> None:
    """A worker's main process counts too and forks pool processes: a child's writer must
    not add the parent's pending counts a second time."""
    # (No counts writer of an earlier test may run: it would take the parent's counts.)
    assert not [t for t in threading.enumerate() if t.name == "celery_throttle-counts"]
    metrics.deferred("a", 2.5)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()

    def child() -> None:
        metrics.admitted(["b"])  # its own count is kept
        child_end.send((metrics.take_seconds(), metrics.snapshot()))

    process = ctx.Process(target=child)
    process.start()
    assert parent_end.poll(20)
    seconds, totals = parent_end.recv()
    process.join(10)
    assert [set(counts) for counts in seconds.values()] == [{("admitted", "b")}]
    assert set(totals) == {"b"}
    assert ("deferred", "a") in next(iter(metrics.take_seconds().values()))  # the parent's


def test_seconds_nobody_takes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a writer taking them, at most KEPT_SECONDS seconds are kept, the newest."""
    now = [0.0]
    monkeypatch.setattr(metrics, "_wall", lambda: now[0])
    for second in range(metrics.KEPT_SECONDS + 50):
        now[0] = float(second)
        metrics.admitted(["a"])
    kept = metrics.take_seconds()
    assert len(kept) == metrics.KEPT_SECONDS
    assert min(kept) == 50
    assert max(kept) == metrics.KEPT_SECONDS + 49


def test_writers_of_two_processes_add_up(client: redis.Redis, prefix: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers' counts of the same second are summed in the store; the key expires."""
    monkeypatch.setattr(metrics, "_wall", lambda: 5_000.5)
    writer = CountsWriter(client, prefix)
    metrics.admitted(["llm"])
    metrics.deferred("llm", 0.25)
    assert writer.write() == 1
    metrics.admitted(["llm", "odd:name"])  # (a name may hold ':')
    assert CountsWriter(client, prefix).write() == 1
    assert writer.write() == 0  # nothing new
    assert read_counts(client, prefix, [4_999, 5_000]) == {
        5_000: {"llm": {"admitted": 2.0, "deferred": 1.0, "wait_seconds_sum": 0.25},
                "odd:name": {"admitted": 1.0}}}
    assert 0 < client.ttl(counts_key(prefix, 5_000)) <= KEPT


def test_a_store_that_does_not_answer_loses_counts_not_the_writer(prefix: str) -> None:
    """Writing to a closed port raises nothing (those seconds' counts are lost)."""
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    metrics.admitted(["llm"])
    assert CountsWriter(dead, prefix).write() == 1


def test_the_writer_thread_writes_every_second(client: redis.Redis, prefix: str) -> None:
    """Started, the writer's thread writes a count within about a second; stop writes the rest."""
    writer = CountsWriter(client, prefix)
    writer.start()
    writer.start()  # (idempotent)
    # Each count is filed under the second it happens in: read every second from before
    # the first to after the second (a loaded machine may put them seconds apart).
    first = int(time.time())
    metrics.admitted(["llm"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if read_counts(client, prefix, list(range(first, int(time.time()) + 1))):
            break
        time.sleep(0.05)
    assert time.monotonic() < deadline  # the thread wrote it, before any stop
    metrics.admitted(["llm"])
    last = int(time.time())
    writer.stop()
    found = read_counts(client, prefix, list(range(first, last + 1)))
    assert sum(c["llm"]["admitted"] for c in found.values()) == 2
