"""The store connection: TLS, credentials, what reaches logs, eviction warnings, no scans."""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import trustme
from celery import Celery

import celery_throttle
from celery_throttle import Gate, store_warnings
from celery_throttle.integration.runtime import forget, runtime_for
from celery_throttle.testing import RedisServer

from ..tls_proxy import TLSProxy

PASSWORD = "hunter2-Zq9"  # must never show up in logs or errors
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    """A throwaway certificate authority."""
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_redis(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[int, str]]:
    """A password-protected Redis behind TLS: (TLS port, CA bundle path)."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    bundle = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    with RedisServer(None, "--requirepass", PASSWORD) as server, TLSProxy(
            server.port, server_ctx) as proxy:
        yield proxy.port, str(bundle)


@pytest.mark.parametrize("user", ["", "default"])
def test_rediss_url_with_credentials(tls_redis: tuple[int, str], prefix: str,
                                     user: str) -> None:
    """rediss:// with a password (and a username, Redis 6 ACL form) and a CA: decisions work."""
    port, bundle = tls_redis
    gate = Gate.from_url(f"rediss://{user}:{PASSWORD}@127.0.0.1:{port}/0"
                         f"?ssl_cert_reqs=required&ssl_ca_certs={bundle}", prefix=prefix)
    try:
        assert gate.acquire("tls", "1/s").allowed
        assert not gate.acquire("tls", "1/s").allowed
        assert "hunter2" not in repr(gate)
    finally:
        gate.client.close()


def test_rediss_from_celery_settings(tls_redis: tuple[int, str], prefix: str) -> None:
    """throttle_redis_url may be a rediss:// URL: the worker's runtime connects with TLS."""
    port, bundle = tls_redis
    app = Celery("tls_app", broker="memory://", set_as_current=False)
    app.conf.throttle_redis_url = (f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
                                   f"?ssl_cert_reqs=required&ssl_ca_certs={bundle}")
    app.conf.throttle_prefix = prefix
    celery_throttle.install(app)
    try:
        gate = runtime_for(app).gate
        assert gate.acquire("tls", "1/s").allowed
        assert PASSWORD not in repr(runtime_for(app).config)
    finally:
        forget(app)


def test_untrusted_certificate_is_refused(tls_redis: tuple[int, str], prefix: str) -> None:
    """A server certificate from an unknown CA fails the connection (no silent fallback)."""
    port, _ = tls_redis
    gate = Gate.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required",
                         prefix=prefix)
    try:
        with pytest.raises(redis.ConnectionError) as info:
            gate.acquire("tls", "1/s")
        assert PASSWORD not in str(info.value)
    finally:
        gate.client.close()


def test_credentials_never_logged_even_at_debug(
    tls_redis: tuple[int, str], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every logger at DEBUG, a wrong and a right password: neither appears anywhere."""
    port, bundle = tls_redis
    query = f"?ssl_cert_reqs=required&ssl_ca_certs={bundle}"
    with caplog.at_level(logging.DEBUG):
        wrong = Gate.from_url(f"rediss://:wrong-{PASSWORD}@127.0.0.1:{port}/0{query}",
                              prefix=prefix)
        with pytest.raises(redis.AuthenticationError) as info:
            wrong.acquire("tls", "1/s")
        wrong.client.close()
        logging.getLogger("test").exception("as an app would log it", exc_info=info.value)
        right = Gate.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0{query}", prefix=prefix)
        right.acquire("tls", "1/s")
        right.client.close()
    assert caplog.records, "nothing was captured: the check would be vacuous"
    assert PASSWORD not in caplog.text
    assert PASSWORD not in str(info.value)


def test_store_warnings_name_an_evicting_policy() -> None:
    """A store that may evict bucket keys is reported; a noeviction one is not."""
    with RedisServer(None, "--maxmemory", "50mb", "--maxmemory-policy", "volatile-lru") as srv:
        client = redis.Redis.from_url(srv.url)
        warnings = store_warnings(client)
        client.config_set("maxmemory-policy", "noeviction")
        assert store_warnings(client) == []
        client.close()
    assert len(warnings) == 1
    assert "maxmemory-policy volatile-lru" in warnings[0]


def test_no_key_scans_and_no_user_input_as_code() -> None:
    """The library never scans the keyspace (KEYS/SCAN) and runs only its own script files.

    User data reaches Redis only as KEYS/ARGV of constant scripts (and as
    hashed key names): nothing is ever formatted into Lua source.
    """
    sources = list((ROOT / "celery_throttle").rglob("*.py"))
    lua = list((ROOT / "celery_throttle").rglob("*.lua"))
    assert sources
    assert lua
    for path in sources:
        text = path.read_text()
        assert not re.search(r"\.(keys|scan|scan_iter)\(|\"KEYS\"|'KEYS'", text), path
        # (A definition, connect.LazyCluster's register_script, is not a call.)
        for call in re.findall(
                r"(?<!def )(?:register_script|eval|evalsha|script_load)\(([^)]*)\)", text):
            # A package file through the one loader (with the files it includes in
            # front), or one of the gate's COMMANDS, each of them such a file.
            first = call.strip().split(",")[0].strip()
            gate_command = first == "text" and "in COMMANDS." in text
            assert first == "script(__package__" or gate_command, (path, call)
    for path in lua:
        body = re.sub(r"--[^\n]*", "", path.read_text())  # comments may name KEYS
        assert not re.search(r"redis\.call\(\s*'(KEYS|SCAN)'", body, re.I), path
        assert "loadstring" not in body
        assert "load(" not in body
