"""Store URLs: their query's options reach every client, bad ones are refused, and both gates
report store failures as redis-py's errors."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import pytest
import redis
from celery import Celery
from redis.exceptions import RedisClusterException

from celery_throttle import AsyncGate, Gate, ThrottleConfigError
from celery_throttle.core.connect import connect, connect_async, query_options
from celery_throttle.integration.config import read_config
from celery_throttle.testing import free_port

TLS_QUERY = "ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required&socket_keepalive=true"


def test_a_cluster_urls_query_reaches_the_sync_client() -> None:
    """rediss+cluster://...?ssl_ca_certs=...: the CA bundle and the other options are used."""
    made = []

    def record(**kwargs: Any) -> Any:
        made.append(kwargs)
        raise RedisClusterException("not started in this test")

    client = connect(f"rediss+cluster://127.0.0.1:{free_port()}?{TLS_QUERY}", socket_timeout=1)
    with mock.patch("celery_throttle.core.connect.RedisCluster", record), \
            pytest.raises(redis.ConnectionError):
        client.ping()
    (kwargs,) = made
    kwargs.pop("startup_nodes")
    assert kwargs == {"ssl": True, "ssl_ca_certs": "/etc/ca.pem", "ssl_cert_reqs": "required",
                      "socket_keepalive": True, "socket_timeout": 1}


def test_a_cluster_urls_query_reaches_the_asyncio_client() -> None:
    """The asyncio cluster client gets the same options on its nodes' connections."""
    client: Any = connect_async(f"rediss+cluster://127.0.0.1:{free_port()}?{TLS_QUERY}")
    kwargs = client.nodes_manager.connection_kwargs
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_cert_reqs"], kwargs["socket_keepalive"]) == (
        "/etc/ca.pem", "required", True)
    assert kwargs["connection_class"].__name__ == "SSLConnection"


def test_a_sentinel_urls_query_reaches_the_masters_connections() -> None:
    """sentinel://...?ssl=true&ssl_ca_certs=...: the master is reached over TLS with the CA."""
    client: Any = connect(f"sentinel://127.0.0.1:{free_port()}?ssl=true&{TLS_QUERY}",
                          master_name="mymaster")
    try:
        pool = client.connection_pool
        assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
        assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    finally:
        client.close()


@pytest.mark.parametrize(("url", "message"), [
    ("rediss+cluster://h:1?ssl_ca_cert=/ca.pem", "'ssl_ca_cert', which is not a connection"),
    ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "sets 'ssl_ca_certs' but not TLS"),
    ("sentinel://h:1?ssl_certfile=/c.pem", "sets 'ssl_certfile' but not TLS"),
    ("redis+cluster://h:1?socket_timeout=1;redis+cluster://h:2?socket_timeout=2",
     "disagree on 'socket_timeout'"),
    ("redis+cluster://h:1?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
])
def test_an_option_that_is_not_understood_is_refused(url: str, message: str) -> None:
    """Never silently dropped: the error names the option (and the install names the
    setting)."""
    with pytest.raises(ValueError, match=message):
        query_options(url)
    app = Celery("q", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.throttle_redis_url = url
    app.conf.throttle_sentinel_master = "mymaster"
    with pytest.raises(ThrottleConfigError, match=f"throttle_redis_url: .*{message}"):
        read_config(app)


def test_both_gates_report_an_unreachable_cluster_as_a_connection_error() -> None:
    """One rule for the store's failures: redis-py's RedisError family, sync and async."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with Gate.from_url(url) as gate, pytest.raises(redis.ConnectionError):
        gate.acquire("api", "1/s")

    async def main() -> None:
        async with AsyncGate.from_url(url) as agate:
            await agate.acquire("api", "1/s")

    with pytest.raises(redis.ConnectionError):
        asyncio.run(main())


def test_closing_a_gate_hands_back_its_connections(redis_url: str, prefix: str) -> None:
    """Gate.close (or ``with``) gives back the connection the packed path keeps."""
    with Gate.from_url(redis_url, prefix=prefix) as gate:
        assert gate.acquire("api", "10/s").allowed
        client: Any = gate.client
        pool = client.connection_pool
        assert len(pool._in_use_connections) == 1  # kept for the next decision
    assert len(pool._in_use_connections) == 0
