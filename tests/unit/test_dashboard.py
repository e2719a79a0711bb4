"""The dashboard's JSON, its controls' secret and cross-site checks, on a real Redis
(served in-process; the page in a real browser: tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_throttle import Limit, metrics, parse_rate, throttled
from celery_throttle.integration.history import CountsWriter
from celery_throttle.integration.runtime import runtime_for
from celery_throttle.ops import report

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from celery_throttle.ops.dashboard import create_app
from celery_throttle.testing import server_url

from .. import databases
from ..conftest import installed_app

TOKEN = "s3cret-token-of-the-test"
GOOD = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    """An app with one shared limit (1/s) and one per-key limit, on this test's prefix."""
    with installed_app("dash", redis_url, prefix) as a:

        @throttled("1/s", name="slow-api")
        @a.task(shared=False, name="dash.call")
        def call() -> None: ...

        @throttled("5/s", name="per-tenant", key="tenant")
        @a.task(shared=False, name="dash.tenant")
        def tenant(tenant: str) -> None: ...

        yield a


def _client(app: Celery, token: str | None = TOKEN) -> TestClient:
    return TestClient(create_app(app, token=token, sample_every=0.2),
                      base_url="http://127.0.0.1:8089")


def _slow(app: Celery) -> Limit:
    return Limit("slow-api", parse_rate("1/s"))


def _paused(app: Celery) -> float:
    return runtime_for(app).gate.inspect(_slow(app)).paused


def test_status_is_the_status_document(app: Celery) -> None:
    """/api/status serves what `status --json` prints: the same rows, the same figures."""
    gate = runtime_for(app).gate
    for _ in range(3):
        gate.acquire_many([_slow(app)], reserve=10)  # one start, two booked ahead
    with _client(app) as web:
        served = web.get("/api/status").json()
    here = report.status(app)
    strip = {"next_free_s", "ttl_s", "used", "fill"}  # (they move with time)
    assert [{k: v for k, v in r.items() if k not in strip} for r in served["limits"]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in here["limits"]]
    row = next(r for r in served["limits"] if r["limit"] == "slow-api")
    assert row["booked_ahead"] == 2
    assert 1.0 <= row["next_free_s"] <= 3.0
    assert served["waiting_room"] == here["waiting_room"]


def test_open_pages_share_a_read_and_an_action_is_seen_at_once(app: Celery) -> None:
    """Within a sampling period every page gets the same read of the store; after an
    action the next read is fresh and shows it."""
    web = TestClient(create_app(app, token=TOKEN, sample_every=30.0),
                     base_url="http://127.0.0.1:8089")
    with web:
        first, second = web.get("/api/status").json(), web.get("/api/status").json()
        assert first == second
        web.post("/api/limits/slow-api/pause", json={"seconds": 30}, headers=GOOD)
        after = web.get("/api/status").json()
    assert after["at"] > first["at"]
    row = next(r for r in after["limits"] if r["limit"] == "slow-api")
    assert row["paused_by"] == "operator"


def test_read_only_without_a_secret(app: Celery) -> None:
    """Started without a secret, every state-changing request is refused and changes nothing."""
    with _client(app, token=None) as web:
        assert web.get("/api/meta").json()["controls"] is False
        for path, body in [("/api/limits/slow-api/pause", {"seconds": 30}),
                           ("/api/limits/slow-api/set", {"rate": "5/s"}),
                           ("/api/purge", {"confirm": "purge"})]:
            reply = web.post(path, json=body, headers=GOOD)
            assert reply.status_code == 403, path
            assert "read-only" in reply.json()["error"]
    assert _paused(app) == 0
    assert runtime_for(app).live.read() == {}


@pytest.mark.parametrize(("headers", "status"), [
    ({"Content-Type": "application/json"}, 401),  # no secret
    ({**GOOD, "Authorization": "Bearer wrong-secret-of-same-len"}, 401),
    ({**GOOD, "Authorization": TOKEN}, 401),  # not a bearer token
    ({**GOOD, "Sec-Fetch-Site": "cross-site"}, 403),  # a browser says another site sent it
    ({**GOOD, "Origin": "http://evil.example"}, 403),
    ({**GOOD, "Content-Type": "application/x-www-form-urlencoded"}, 415),  # a plain form
])
def test_a_request_without_the_secret_or_from_another_site_changes_nothing(
        app: Celery, headers: dict[str, str], status: int) -> None:
    """Each forged or unauthenticated pause is refused with its reason; the limit runs on."""
    with _client(app) as web:
        reply = web.post("/api/limits/slow-api/pause", content=b'{"seconds": 30}',
                         headers=headers)
    assert reply.status_code == status, reply.text
    assert _paused(app) == 0


def test_the_controls_with_the_secret(app: Celery) -> None:
    """Pause (shown as the operator's), resume, set and unset a rate, shadow mode on and
    unset, purge with confirmation."""
    with _client(app) as web:
        same_site = {**GOOD, "Origin": "http://127.0.0.1:8089", "Sec-Fetch-Site": "same-origin"}
        reply = web.post("/api/limits/slow-api/pause", json={"seconds": 30}, headers=same_site)
        assert reply.json() == {"paused_s": 30.0}
        assert 29 < _paused(app) <= 30
        row = next(r for r in web.get("/api/status").json()["limits"]
                   if r["limit"] == "slow-api")
        assert row["paused_by"] == "operator"
        assert web.post("/api/limits/slow-api/resume", json={}, headers=GOOD).json() == {
            "resumed": True}
        assert _paused(app) == 0
        assert web.post("/api/limits/slow-api/set", json={"rate": "20/s", "burst": 4},
                        headers=GOOD).json() == {"rate": "20/s", "burst": 4}
        assert str(runtime_for(app).live.read()["slow-api"][0]) == "20/s"
        assert web.post("/api/limits/slow-api/unset", json={}, headers=GOOD).json() == {
            "had_a_rate_set": True}
        assert runtime_for(app).live.read() == {}
        assert web.post("/api/limits/slow-api/shadow", json={"mode": "on"},
                        headers=GOOD).json() == {"enforced": False}
        assert runtime_for(app).live.read_enforce() == {"slow-api": False}
        assert web.post("/api/limits/slow-api/shadow", json={"mode": "unset"},
                        headers=GOOD).json() == {"enforced": None}
        assert runtime_for(app).live.read_enforce() == {}
        refused = web.post("/api/purge", json={}, headers=GOOD)
        assert refused.status_code == 400
        assert "confirm" in refused.json()["error"]
        assert web.post("/api/purge", json={"confirm": "purge"}, headers=GOOD).json() == {
            "dropped": 0, "revoked": 0}
        assert web.post("/api/limits/slow-api/purge", json={"confirm": "slow-api"},
                        headers=GOOD).json() == {"revoked": 0}


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/api/limits/nope/pause", {}, 404, "unknown limit 'nope'"),
    ("/api/limits/slow-api/pause", {"seconds": -1}, 400, "-1"),
    ("/api/limits/slow-api/pause", {"seconds": "soon"}, 400, "'soon'"),
    ("/api/limits/slow-api/set", {"rate": "fast"}, 400, "fast"),
    ("/api/limits/slow-api/set", {"rate": "5/s", "burst": 0}, 400, "0"),
    ("/api/limits/per-tenant/pause", {}, 400, "per key"),
    ("/api/limits/slow-api/explode", {}, 400, "'explode'"),
    ("/api/limits/slow-api/shadow", {"mode": "maybe"}, 400, "'maybe'"),
    ("/api/limits/slow-api/purge", {"confirm": "purge"}, 400, '"confirm": "slow-api"'),
])
def test_bad_input_is_named_and_changes_nothing(app: Celery, path: str, body: dict[str, Any],
                                                status: int, says: str) -> None:
    """A bad name, number, rate or action gets an error naming it; no limit changes."""
    with _client(app) as web:
        reply = web.post(path, json=body, headers=GOOD)
    assert reply.status_code == status
    assert says in reply.json()["error"]
    assert _paused(app) == 0
    assert runtime_for(app).live.read() == {}
    assert runtime_for(app).live.read_enforce() == {}


def test_only_loopback_names_are_served_on_loopback(app: Celery) -> None:
    """Bound to 127.0.0.1, a request naming another host (DNS rebinding) is refused."""
    with _client(app) as web:
        assert web.get("/api/meta", headers={"Host": "evil.example"}).status_code == 400
        assert web.get("/api/meta", headers={"Host": "localhost:8089"}).status_code == 200


def test_the_page_never_shows_the_store_password(redis_url: str, prefix: str) -> None:
    """A store URL with a password is shown without it."""
    a = Celery("pw", broker=f"{server_url(redis_url)}/{databases.UNIT}", set_as_current=False)
    a.conf.throttle_redis_url = redis_url.replace("redis://", "redis://user:hunter2@")
    a.conf.throttle_prefix = prefix
    try:
        with _client(a) as web:
            meta = web.get("/api/meta").text
        assert "hunter2" not in meta
        assert "**" in meta
    finally:
        a.close()


def test_why_and_its_bad_input(app: Celery) -> None:
    """/api/why is `why --json`; an id that cannot be one is refused."""
    with _client(app) as web:
        assert web.get("/api/why/abc-123").json() == {"task_id": "abc-123", "waiting": None}
        assert web.get("/api/why/" + "x" * 300).status_code == 400


def test_history_charts_the_workers_counts_and_the_sampled_waiting(
        app: Celery, client: redis.Redis, prefix: str) -> None:
    """Counts written by a worker's writer and the sampled waiting tasks appear per second."""
    metrics.keep_seconds(True)
    try:
        metrics.admitted(["slow-api"])
        metrics.deferred("slow-api", 1.0)
        CountsWriter(client, prefix).write()
    finally:
        metrics.keep_seconds(False)
    gate = runtime_for(app).gate
    for _ in range(4):
        gate.acquire_many([_slow(app)], reserve=10)
    with _client(app) as web:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            hist = web.get("/api/history").json()
            series = hist["limits"].get("slow-api", {})
            if any(v for v in series.get("waiting", []) if v):
                break
            time.sleep(0.1)
        later = web.get(f"/api/history?after={hist['to']}").json()
    assert len(series["admitted"]) == hist["to"] - hist["from"] + 1 == 900
    assert sum(series["admitted"]) == 1
    assert sum(series["deferred"]) == 1
    assert max(v for v in series["waiting"] if v is not None) == 3
    assert set(series["limit_per_s"]) <= {None, 1.0}
    assert later["from"] >= hist["to"] - 5  # only the newest seconds again
