"""The store on Redis Sentinel and on Redis Cluster, without workers: real server processes
(tests/servers.py starts and stops them), a real resharding."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
import redis

from celery_throttle import AsyncGate, Concurrency, Gate, Limit, parse_rate
from celery_throttle.core.connect import connect
from celery_throttle.core.keys import bucket_key
from celery_throttle.room.durability import judge
from celery_throttle.room.envelope import Envelope
from celery_throttle.room.parking import WaitingRoom

from ..servers import MASTER, Cluster, SentinelGroup, key_slot


def test_a_cluster_store_persists_only_if_every_primary_does(redis_cluster: Cluster) -> None:
    """Waiting tasks may wait in a cluster only if each primary appends to disk (a slot,
    and the room with it, can move to any of them)."""
    client = connect(redis_cluster.url)
    nodes = [redis_cluster.client(i) for i in range(3)]
    try:
        verdicts = []
        for node in nodes:
            verdicts.append(judge(client, replicas=0, same_url=False, broker_id=lambda: None))
            node.config_set("appendonly", "yes")
        verdicts.append(judge(client, replicas=0, same_url=False, broker_id=lambda: None))
    finally:
        for node in nodes:
            node.config_set("appendonly", "no")
            node.close()
        client.close()
    assert [v.safe for v in verdicts] == [False, False, False, True]


def test_cluster_gate_room_and_leases_keep_one_slot(redis_cluster: Cluster, prefix: str) -> None:
    """On a 3-master cluster: a multi-limit decision, leases, inspection and the waiting room
    work, and every key they write is in the prefix's one slot."""
    gate = Gate.from_url(redis_cluster.url, prefix=prefix)
    # Slow rates: a bucket's key lives until its limit is free again, and the
    # keys are counted below (at 10/s a loaded run took longer than the 0.2 s
    # the provider's key lived, and saw 3 keys).
    tenant = Limit("tenant", parse_rate("5/m"), 2, key="acme")
    provider = Limit("provider", parse_rate("6/m"), 1)
    inflight = Concurrency("inflight", 2, lease=5)
    first = gate.acquire_many([tenant, provider, inflight], holder="job-1")
    second = gate.acquire_many([tenant, provider, inflight], holder="job-2", reserve=15)
    assert first.allowed
    assert not second.allowed
    assert second.reserved
    assert gate.inspect(provider).booked_ahead == 1
    assert gate.inspect_leases(inflight).held == 1
    assert gate.release([inflight], "job-1") == 1
    room = WaitingRoom(connect(redis_cluster.url), prefix)
    message = Envelope(b"{}", "application/json", "utf-8", "", "celery", {"id": "t1"}).dumps()
    room.park("e1", message, "t1", delay_us=60_000_000, note='{"due": 1}')
    assert room.state().parked == 1
    assert room.next_parked(5)[0].note == b'{"due": 1}'
    assert room.purge() == ["t1"]  # the task ids of what it dropped
    written: set[str] = set()
    for node in range(3):
        with contextlib.closing(redis_cluster.client(node)) as cli:
            written |= {k.decode() for k in cli.scan_iter(match=f"{{{prefix}}}*")}
    assert len(written) >= 4  # tenant, provider, leases, meta, a note ...
    with contextlib.closing(redis_cluster.client(0)) as cli:
        assert {key_slot(cli, k) for k in written} == {key_slot(cli, bucket_key(prefix, "x"))}
    gate.client.close()


def test_async_gate_on_the_cluster(redis_cluster: Cluster, prefix: str) -> None:
    """AsyncGate on redis.asyncio's RedisCluster shares the sync gate's bucket."""
    lim = Limit("shared", parse_rate("1/s"), 1)

    async def main() -> tuple[bool, bool, float]:
        agate = AsyncGate.from_url(redis_cluster.url, prefix=prefix)
        try:
            a = await agate.acquire_many([lim])
            b = await agate.acquire_many([lim])
            return a.allowed, b.allowed, (await agate.inspect(lim)).next_free
        finally:
            await agate.aclose()

    allowed, again, next_free = asyncio.run(main())
    assert allowed
    assert not again
    assert 0 < next_free <= 1
    assert not Gate.from_url(redis_cluster.url, prefix=prefix).acquire_many([lim]).allowed


def test_moved_after_resharding_the_prefix_slot_is_survived(redis_cluster: Cluster,
                                                            prefix: str) -> None:
    """The prefix's slot moves to another master, keys and all: the gate's next decision
    follows MOVED to the new owner and finds the bucket as it was."""
    gate = Gate.from_url(redis_cluster.url, prefix=prefix)
    lim = Limit("api", parse_rate("1/10s"), 1)
    leases = Concurrency("calls", 1, lease=30)
    assert gate.acquire_many([lim]).allowed
    assert gate.acquire_many([leases], holder="a").allowed
    with contextlib.closing(redis_cluster.client(0)) as cli:
        slot = key_slot(cli, bucket_key(prefix, "api"))
    before = redis_cluster.owner(slot)
    assert redis_cluster.move_slot(slot, (before + 1) % 3) >= 2
    assert redis_cluster.owner(slot) != before
    assert not gate.acquire_many([lim]).allowed  # the bucket moved with its slot
    assert not gate.acquire_many([leases], holder="b").allowed  # so did the lease
    assert 9 < gate.inspect(lim).next_free <= 10
    gate.client.close()


def test_tasks_in_line_survive_a_reshard_mid_dispatch(redis_cluster: Cluster,
                                                      prefix: str) -> None:
    """300 tasks in line; once at least 100 are dispatched the prefix's slot moves to
    another master, queues, records and all: the rest are dispatched from there, each task
    exactly once, none lost."""
    room = WaitingRoom(connect(redis_cluster.url), prefix)
    line = Limit("line", parse_rate("1000/s"))
    for i in range(300):
        room.enqueue(f"e{i}", b"m", f"t{i}", limits=[line], blocking=line, place_us=i)
    served: list[str] = []

    def dispatch_until(count: int) -> None:  # as a dispatcher does, bounded
        deadline = time.monotonic() + 20
        while len(served) < count and time.monotonic() < deadline:
            wait, batch = room.lines.serve_due(50, 60_000_000)
            served.extend(item.entry for item in batch)
            if wait is None:
                return
            time.sleep(min(wait, 0.05))

    dispatch_until(100)
    with contextlib.closing(redis_cluster.client(0)) as cli:
        slot = key_slot(cli, line.line_in(prefix).decode())
    before = redis_cluster.owner(slot)
    assert redis_cluster.move_slot(slot, (before + 1) % 3) >= 4  # queue, messages, claimed ...
    assert redis_cluster.owner(slot) != before
    dispatch_until(300)
    assert len(served) == 300
    assert sorted(served) == sorted(f"e{i}" for i in range(300))  # each once
    assert room.lines.waiting() == 0
    room.client.close()


def test_a_park_returns_once_a_replica_has_it(prefix: str, caplog: pytest.LogCaptureFixture,
                                              redis_url: str) -> None:
    """throttle_park_replicas: a park (or a task put in line) is on the replica when it
    returns; with no replica to acknowledge, it returns after the WAIT timeout with a
    WARNING."""
    with SentinelGroup() as group:
        master = connect(group.url, master_name=MASTER)
        room = WaitingRoom(master, prefix, replicas=1)
        replica = redis.Redis(port=group.replica.port)
        for i in range(20):  # each park is already on the replica when park() returns
            room.park(f"e{i}", b"{}", f"t{i}", delay_us=60_000_000)
            assert replica.zscore(room.parked, f"e{i}") is not None
        line = Limit("line", parse_rate("1/s"))
        for i in range(20):  # ... and so is a task put in line
            room.enqueue(f"q{i}", b"{}", f"u{i}", limits=[line], blocking=line, place_us=i)
            assert replica.zscore(line.line_in(prefix), f"q{i}") is not None
        replica.close()
        master.close()

        async def decide() -> bool:  # the asyncio client follows the same master
            agate = AsyncGate.from_url(group.url, master_name=MASTER, prefix=prefix)
            try:
                return (await agate.acquire("async", "1/s")).allowed
            finally:
                await agate.aclose()

        assert asyncio.run(decide())
    alone = WaitingRoom(redis.Redis.from_url(redis_url), prefix, replicas=1)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="celery_throttle"):
        alone.park("lonely", b"{}", "t", delay_us=60_000_000)
        waited = time.monotonic() - started
        alone.park("next", b"{}", "t2", delay_us=60_000_000)  # no second wait for nothing
    assert 0.4 < waited < 3
    assert time.monotonic() - started - waited < 0.3
    assert caplog.text.count("reached 0 of 1 replicas") == 1
    assert len(alone.purge()) == 2
