"""Whether waiting tasks may wait in the store (room/durability.py), judged on real servers."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_throttle.integration.config import read_config
from celery_throttle.integration.runtime import durability_of
from celery_throttle.room.durability import RECHECK_S, Durability, Verdict
from celery_throttle.testing import RedisServer

from ..clock import StepClock
from ..workers import ROOT, app_env


@pytest.fixture
def plain() -> Iterator[RedisServer]:
    """A store of its own that keeps nothing on disk (a cache-like Redis)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def other() -> Iterator[RedisServer]:
    """Another server, the broker's (what it keeps does not matter: it is not killed)."""
    with RedisServer() as server:
        yield server


def _durability(store: str, broker: str, clock: StepClock | None = None,
                **settings: object) -> Durability:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(throttle_redis_url=store, **settings)
    config = read_config(app)
    found = durability_of(config, config.connect(socket_timeout=2, socket_connect_timeout=1))
    if clock is not None:
        found.clock = clock
    return found


def test_the_brokers_own_server_is_safe_whatever_it_keeps(plain: RedisServer) -> None:
    """Store and broker in two databases of one server without persistence: safe (one fate)."""
    verdict = _durability(f"{plain.url}/11", f"{plain.url}/10").verdict()
    assert verdict == Verdict(True, "the store is the broker's own Redis server")


def test_the_broker_url_itself_is_safe_without_asking_the_server() -> None:
    """The store is the broker's URL (throttle_redis_url unset): safe with no round trip."""
    app = Celery("t", broker="redis://127.0.0.1:1/0", set_as_current=False)  # nothing listens
    config = read_config(app)
    assert durability_of(config, config.connect(socket_connect_timeout=0.2)).safe()


def test_a_separate_store_without_persistence_is_not_safe(plain: RedisServer,
                                                          other: RedisServer) -> None:
    """A cache-like store beside another broker, not kept there: not safe, and the reason
    says why."""
    verdict = _durability(f"{plain.url}/0", f"{other.url}/0",
                          throttle_keep_beside_broker=False).verdict()
    assert not verdict.safe
    assert "appendonly no" in verdict.reason
    assert "not the broker's server" in verdict.reason


def test_a_separate_store_without_persistence_keeps_tasks_beside_a_redis_broker(
        plain: RedisServer, other: RedisServer) -> None:
    """By default the same store is safe with a copy kept on the broker's server, or in a
    log on a RabbitMQ broker (room/logged.py); a store down is not safe."""
    verdict = _durability(f"{plain.url}/0", f"{other.url}/0").verdict()
    assert (verdict.safe, verdict.kept) == (True, True)
    assert "appendonly no" in verdict.reason
    assert "kept beside the broker's queues" in verdict.reason
    on_rabbitmq = _durability(f"{plain.url}/0", "amqp://guest@127.0.0.1:1//",
                              throttle_keep_beside_broker=True).verdict()
    assert (on_rabbitmq.safe, on_rabbitmq.kept) == (True, True)
    assert "kept in a log on the broker (RabbitMQ)" in on_rabbitmq.reason
    assert not _durability("redis://127.0.0.1:1/0", f"{other.url}/0",
                           throttle_keep_beside_broker=True).safe()
    # A store that is safe alone needs no copy.
    assert _durability(f"{other.url}/1", f"{other.url}/0",
                       throttle_keep_beside_broker=True).verdict().kept is False


def test_a_broker_with_no_place_to_keep_tasks_needs_a_persistent_store(
        plain: RedisServer) -> None:
    """A broker that is neither Redis nor RabbitMQ (SQS), or RabbitMQ with the setting off: a
    store without persistence is not safe."""
    assert not _durability(f"{plain.url}/0", "sqs://key:secret@").safe()
    assert not _durability(f"{plain.url}/0", "amqp://guest@127.0.0.1:1//",
                           throttle_keep_beside_broker=False).safe()


def test_a_store_that_appends_to_disk_is_safe(other: RedisServer) -> None:
    """appendonly yes: safe, whatever server the broker is."""
    with RedisServer(None, "--appendonly", "yes") as aof:
        verdict = _durability(f"{aof.url}/0", f"{other.url}/0").verdict()
    assert verdict == Verdict(True, "the store appends every write to disk (appendonly yes)")


def test_always_and_replicas_are_safe_without_asking(other: RedisServer) -> None:
    """throttle_waiting_room="always", or parks waiting for replicas: safe, no round trip."""
    nowhere = "redis://127.0.0.1:1/0"
    assert _durability(nowhere, f"{other.url}/0", throttle_waiting_room="always").safe()
    verdict = _durability(nowhere, f"{other.url}/0", throttle_park_replicas=1).verdict()
    assert verdict.safe
    assert "replica" in verdict.reason


def test_a_change_is_seen_at_the_next_check_and_logged_once(
        plain: RedisServer, other: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Turned on live: seen after an invalidation (a store error) or RECHECK_S, logged once."""
    clock = StepClock()
    durability = _durability(f"{plain.url}/0", f"{other.url}/0", clock,
                             throttle_keep_beside_broker=False)
    with contextlib.closing(redis.Redis.from_url(plain.url)) as admin:
        assert not durability.safe()
        admin.config_set("appendonly", "yes")
        assert not durability.safe()  # checked once per RECHECK_S
        durability.invalidate()
        with caplog.at_level(logging.WARNING, logger="celery_throttle"):
            assert durability.safe()
            assert durability.safe()
        assert [r.getMessage() for r in caplog.records] == [
            "celery_throttle: the waiting room is now in use: the store appends every write "
            "to disk (appendonly yes)"]
        admin.config_set("appendonly", "no")
        clock.us += int((RECHECK_S - 1) * 1_000_000)
        assert durability.safe()
        clock.us += 1_000_000
        assert not durability.safe()


def test_an_unreachable_store_is_not_safe_until_it_answers(other: RedisServer) -> None:
    """Store down: not safe (checked again a second later, quietly); back: safe again."""
    clock = StepClock()
    with RedisServer(None, "--appendonly", "yes") as aof:
        durability = _durability(f"{aof.url}/0", f"{other.url}/0", clock)
        assert durability.safe()
        aof.kill()
        durability.invalidate()
        verdict = durability.verdict()
        assert not verdict.safe
        assert "could not be checked" in verdict.reason
        aof.start()
        assert not durability.safe()  # the next check is a second away
        clock.us += 1_000_000
        assert durability.safe()


def test_a_store_that_refuses_info_is_not_safe(other: RedisServer) -> None:
    """INFO refused (an ACL without it): nothing can be known, so not safe; the reason says so."""
    with RedisServer(None, "--appendonly", "yes") as aof:
        with contextlib.closing(redis.Redis.from_url(aof.url)) as admin:
            admin.acl_setuser("app", enabled=True, passwords=["+pw"], keys=["*"],
                              commands=["+@all", "-info"])
        verdict = _durability(f"redis://app:pw@127.0.0.1:{aof.port}/0",
                              f"{other.url}/0", throttle_keep_beside_broker=False).verdict()
    assert not verdict.safe
    assert "cannot be read" in verdict.reason
    assert "pw" not in verdict.reason


def test_bad_values_of_the_setting_are_refused() -> None:
    """throttle_waiting_room takes True, False or "always", and says so."""
    app = Celery("t", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.throttle_waiting_room = "sometimes"
    with pytest.raises(Exception, match=r"throttle_waiting_room='sometimes': expected True "
                                        r"or False or \"always\""):
        read_config(app)


def _status(redis_base: str, conf: dict[str, object]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **app_env(redis_base, conf)}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.celery_app", "throttle",
                           "status", "patient"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=False)


def test_status_says_whether_waiting_tasks_wait_in_the_store(redis_base: str,
                                                             plain: RedisServer) -> None:
    """`throttle status` names the reason when the store is not used for waiting tasks, or
    is used with each task kept beside the broker's queues."""
    beside = _status(redis_base, {})  # the test app's store: the broker's server
    apart = _status(redis_base, {"throttle_redis_url": f"{plain.url}/0",
                                 "throttle_keep_beside_broker": False})
    kept = _status(redis_base, {"throttle_redis_url": f"{plain.url}/0"})
    assert beside.returncode == 0, beside.stderr
    assert apart.returncode == 0, apart.stderr
    assert kept.returncode == 0, kept.stderr
    assert "waiting room not used" not in beside.stdout
    assert "waiting room not used" not in kept.stdout
    assert ("waiting room in use: the store keeps waiting tasks in memory only (appendonly no) "
            "and is not the broker's server: a restart of it would lose them, so each waiting "
            "task is also kept beside the broker's queues, on its Redis server") in kept.stdout
    assert ("waiting room not used: the store keeps waiting tasks in memory only (appendonly "
            "no) and is not the broker's server") in apart.stdout


def test_a_forked_process_keeps_the_verdict_of_the_process_that_forked_it(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool process a node forks (a recycled one's replacement) answers the node's verdict
    on the store until it is due, asking the store nothing about its configuration; a
    runtime that was this process's own passes nothing on."""
    import dataclasses

    from celery_throttle.integration import runtime as runtimes
    from celery_throttle.room import durability as judged

    from ..conftest import installed_app

    with installed_app("forked", redis_url, prefix, throttle_waiting_room=True) as app:
        node = runtimes.runtime_for(app)
        known = node.durability.verdict()
        with runtimes._lock:  # (what a fork leaves: the node's runtime, another pid's)
            runtimes._cache[app] = dataclasses.replace(node, pid=-1)
        runtimes.forget(app)  # (not this process's: left for runtime_for to replace)
        asked: list[object] = []

        def judge(*args: object, **_: object) -> Verdict:
            asked.append(args)
            return known

        monkeypatch.setattr(judged, "judge", judge)
        child = runtimes.runtime_for(app)
        assert child.durability is not node.durability
        assert child.durability.verdict() is known
        assert asked == []
        runtimes.forget(app)  # (its own: closed, nothing passed on)
        assert runtimes.runtime_for(app).durability._current is None
        node.gate.client.close()
