"""The settings (config.py): defaults, and a clear error naming every bad or unknown one."""

from __future__ import annotations

from typing import Any, ClassVar, cast
from unittest import mock

import pytest
import redis
from celery import Celery
from redis.exceptions import RedisClusterException

import celery_throttle
from celery_throttle import ThrottleConfigError
from celery_throttle.core.connect import connect
from celery_throttle.integration.config import REMOVED, SETTINGS, read_config
from celery_throttle.room.ladder import MAX_DELAY_MS
from celery_throttle.testing import free_port


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("throttle_queues", {"llm": "bogus"}, r"throttle_queues\['llm'\]: invalid rate 'bogus'"),
        ("throttle_queues", {"llm": {"rate": "1/s", "brust": 2}}, r"throttle_queues\['llm'\]"),
        ("throttle_queues", ["llm"], "expected a dict"),
        ("throttle_on_error", "ignore", "throttle_on_error='ignore'"),
        ("throttle_max_wait", "10", "throttle_max_wait='10'"),
        ("throttle_prefix", "{x}", "throttle_prefix"),
        ("throttle_redis_url", "amqp://guest@localhost//",
         r"redis://, rediss://, unix://, sentinel:// or redis\+cluster:// URL is needed "
         r"\(the scheme is 'amqp'\)"),
        ("throttle_redis_url", "sentinel://127.0.0.1:26379", "needs the master's name"),
        ("throttle_redis_url", "redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("throttle_redis_url", "redis+cluster:///", "names host:port"),
        ("throttle_park_replicas", -1, "throttle_park_replicas=-1"),
        ("throttle_sentinel_kwargs", "x", "expected a dict"),
        ("throttle_queus", {}, "unknown setting 'throttle_queus'; did you mean 'throttle_queues'"),
        ("throttle_seats_in_line", False, "setting 'throttle_seats_in_line' was removed in "
                                          "0.2.0: a task with a concurrency limit always"),
        ("throttle_line_on_arrival", True, "setting 'throttle_line_on_arrival' was removed "
                                           "in 0.2.0"),
        ("throttle_scheduler", True, "setting 'throttle_scheduler' was removed in 0.2.0"),
        ("throttle_priority_ageing", 0.5, "throttle_priority_ageing=0.5"),
        ("throttle_fair_weights", ["a"], "throttle_fair_weights: expected a dict"),
        ("throttle_fair_weights", {"openai": {"acme": 0}},
         r"throttle_fair_weights\['openai'\]: weight 0: expected an integer >= 1"),
        ("throttle_pool_check_interval", -1, r"throttle_pool_check_interval=-1: expected "
                                              r"seconds >= 0 or None"),
        ("throttle_fair_weights", {"openai": {1.5: 2}},
         r"throttle_fair_weights\['openai'\]: invalid key value of type float"),
    ],
)
def test_bad_settings_fail_at_install(
    app: Celery, setting: str, value: object, message: str
) -> None:
    """install() raises ThrottleConfigError naming the bad or unknown setting."""
    app.conf[setting] = value
    with pytest.raises(ThrottleConfigError, match=message):
        celery_throttle.install(app)



def test_a_removed_setting_is_no_longer_a_setting() -> None:
    """Every removed name has its own error, never a "did you mean" to a setting."""
    assert not set(REMOVED) & set(SETTINGS)
    assert all(name.startswith("throttle_") for name in REMOVED)


def test_config_defaults(app: Celery) -> None:
    """Defaults: broker URL as store, 'defer', half the visibility timeout as max countdown."""
    app.conf.broker_transport_options = {"visibility_timeout": 600}
    config = read_config(app)
    assert config.redis_url == app.conf.broker_url
    assert config.on_error == "defer"
    assert config.max_countdown == 300.0
    assert "redis://" not in repr(config)  # the URL (and any password) stays out of reprs
    assert config.park_replicas == 0  # one server: nothing to wait for
    assert config.pool_check_interval is None  # (recycling.DEFAULT_INTERVAL where recycled)
    # Every literal default SETTINGS states (and the settings page tables) is the one read.
    literal = {name: default for name, (default, _) in SETTINGS.items() if default is not None}
    assert len(literal) >= 10
    for name, default in literal.items():
        value = getattr(config, name.removeprefix("throttle_"))
        assert value == (() if name == "throttle_queues" else default), name  # ({} read)


def test_an_amqp_broker_has_no_visibility_timeout_to_halve(app: Celery) -> None:
    """On RabbitMQ a countdown waits on the delay ladder, held by no worker: a visibility
    timeout set for it (it ignores one) does not cut countdowns short; one trip, as long as
    the ladder's longest."""
    app.conf["broker_url"] = "amqp://guest:guest@127.0.0.1:5672//"
    app.conf.broker_transport_options = {"visibility_timeout": 8}
    app.conf.throttle_redis_url = "redis://127.0.0.1:6379/0"
    assert read_config(app).max_countdown == MAX_DELAY_MS / 1000
    app.conf["broker_url"] = "redis://127.0.0.1:6379/1"
    assert read_config(app).max_countdown == 4.0


def test_sentinel_broker_is_the_default_store_with_its_master_name(app: Celery) -> None:
    """A sentinel:// broker is the store, with the broker's master_name and sentinel_kwargs."""
    app.conf["broker_url"] = "sentinel://:pw@127.0.0.1:26379/2;sentinel://127.0.0.1:26380"
    app.conf.broker_transport_options = {"master_name": "mymaster",
                                         "sentinel_kwargs": {"password": "spw"}}
    config = read_config(app)
    assert (config.redis_url, config.sentinel_master) == (app.conf.broker_url, "mymaster")
    assert config.park_replicas == 1  # a parked task waits until a replica has it
    assert "pw" not in repr(config)
    client = config.connect()
    try:
        pool: Any = cast(redis.Redis, client).connection_pool  # a SentinelConnectionPool
        assert (pool.service_name, pool.connection_kwargs["password"],
                pool.connection_kwargs["db"]) == ("mymaster", "pw", 2)
        sentinels = pool.sentinel_manager.sentinels
        assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [26379, 26380]
        assert sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
    finally:
        client.close()
    app.conf.throttle_sentinel_master = "other"  # the setting beats the broker's option
    assert read_config(app).sentinel_master == "other"


def test_cluster_url_makes_a_cluster_client_of_every_start_node() -> None:
    """redis+cluster:// with ';'-joined start nodes, credentials from the first part."""
    port = free_port()  # nothing listens there: the client is made at its first use
    client = connect(f"rediss+cluster://u:p%40ss@127.0.0.1:{port};"
                     "redis+cluster://127.0.0.1:7001", socket_timeout=1)
    made = []

    def record(**kwargs: Any) -> Any:
        made.append(kwargs)
        raise RedisClusterException("Redis Cluster cannot be connected")

    with mock.patch("celery_throttle.core.connect.RedisCluster", record), \
            pytest.raises(redis.ConnectionError, match="cannot be connected"):
        client.ping()  # an unreachable cluster is a RedisError: on_error's policy applies
    (kwargs,) = made
    assert [(n.host, n.port) for n in kwargs.pop("startup_nodes")] == [
        ("127.0.0.1", port), ("127.0.0.1", 7001)]
    assert kwargs == {"ssl": True, "password": "p@ss", "username": "u", "socket_timeout": 1}


class DjangoSettings:
    """A Django settings module's shape: upper-case names, the CELERY_ namespace."""

    CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    CELERY_TASK_ACKS_LATE = True
    CELERY_THROTTLE_QUEUES: ClassVar = {"llm": {"rate": "60/m", "burst": 5}}
    CELERY_THROTTLE_PREFIX = "site"
    CELERY_THROTTLE_MAX_SLEEP = 0.2
    DEBUG = True  # not Celery's: ignored


def test_django_style_namespaced_settings_are_read() -> None:
    """config_from_object(settings, namespace="CELERY"): CELERY_THROTTLE_* are the settings,
    and a misspelled one is named as written, with the spelling to use."""
    app = Celery("proj", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    config = read_config(app)
    (queue,) = config.queues
    assert (queue.queue, queue.limit.burst, str(queue.limit.rate)) == ("llm", 5, "60/m")
    assert (config.prefix, config.max_sleep, config.redis_url) == (
        "site", 0.2, DjangoSettings.CELERY_BROKER_URL)

    class Misspelled(DjangoSettings):
        CELERY_THROTTLE_QUEUS: ClassVar = {"llm": "1/s"}

    bad = Celery("proj", set_as_current=False)
    bad.config_from_object(Misspelled, namespace="CELERY")
    with pytest.raises(ThrottleConfigError,
                       match="unknown setting 'CELERY_THROTTLE_QUEUS'; did you mean "
                             "'CELERY_THROTTLE_QUEUES'"):
        read_config(bad)
