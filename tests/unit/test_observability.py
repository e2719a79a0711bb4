"""What an operator sees without workers: counts per limit, log lines, rate changes, and
`celery throttle` on a given state."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.exceptions import Ignore

from celery_throttle import Concurrency, Gate, Limit, metrics, parse_rate, throttled
from celery_throttle.core.keys import key_digest
from celery_throttle.integration.notes import read_wait
from celery_throttle.integration.runtime import forget, runtime_for
from celery_throttle.room.entries import entry_id
from celery_throttle.room.envelope import capture
from celery_throttle.room.header import HEADER, WaitState
from celery_throttle.testing import free_port

from .. import databases
from ..clock import T0, StepClock
from ..conftest import REQUIRE_SERVERS, installed_app
from ..workers import ROOT, PublishRecorder, app_env, throttle_cli


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    """An app on the test server with this test's own bucket prefix (never started)."""
    with installed_app("obs", redis_url, prefix) as a:
        yield a


def test_counts_log_line_and_wait_note_after_a_known_run(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Three calls at 1/s: 1 admitted, 2 deferred (waits 1 s and 2 s), one INFO line each."""
    published: list[dict[str, Any]] = []
    # The countdown path, whose publish the recorder stands in for (parked
    # tasks' notes and counts: tests/unit/test_parking.py).
    app.conf.throttle_waiting_room = False
    forget(app)

    @throttled("1/s", name="llm")
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any]) -> str:
        return "ran"

    job.signature_from_request = lambda request, **options: PublishRecorder(published, options)  # type: ignore[method-assign,assignment]
    metrics.reset()
    # As a worker does at start: importing prometheus_client (tens of ms) on
    # the first call would shorten the later waits by that much (seen: 2.94 s).
    metrics.prepare()
    with caplog.at_level(logging.INFO, logger="celery_throttle"):
        for i in range(3):
            job.push_request(id=f"task-{i}", called_directly=False, delivery_info={},
                             headers=None)
            try:
                if i == 0:
                    assert job.run() == "ran"
                else:
                    with pytest.raises(Ignore):
                        job.run()
            finally:
                job.pop_request()
    counts = metrics.snapshot()["llm"]
    assert counts["admitted"] == 1
    assert counts["deferred"] == 2
    assert counts["wait_seconds_sum"] == pytest.approx(3.0, abs=0.05)  # 1 s + 2 s
    assert counts["store_errors"] == 0
    lines = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()]
    assert len(lines) == 2
    assert re.fullmatch(r"throttle: task [\w.]*job\[task-2\] waits 1\.9\d\ds for limit 'llm' "
                        r"\(deferral 1\)", lines[1]) or re.fullmatch(
        r"throttle: task [\w.]*job\[task-2\] waits 2\.0\d\ds for limit 'llm' \(deferral 1\)",
        lines[1]), lines[1]
    note = read_wait(runtime_for(app), "task-2")
    assert note is not None
    assert note["limit"] == "llm"
    assert note["booked"] is True
    assert note["deferrals"] == 1
    assert 1.9 < note["due_in_s"] <= 2.0
    assert read_wait(runtime_for(app), "task-0") is None  # started at once: nothing recorded


def test_why_reads_a_task_in_line_from_its_entry(app: Celery) -> None:
    """A task in line stores no note of its own: `why` finds its record from its task id
    (a copy in line again, from a pointer to its entry), reads its task, limit, deferrals
    and place from it, estimates its start at the rate in force, and forgets it once it
    left the line."""
    runtime = runtime_for(app)
    room = runtime.room
    limit = Limit("line", parse_rate("2/s"))

    @app.task(shared=False, name="proj.in_line")
    def job(i: int) -> int:
        return i

    sec, usec = runtime.gate.client.time()
    now = int(sec) * 1_000_000 + int(usec)
    # The user's own messages of t0 and t1, a copy of t2 in line again.
    entries = [entry_id("t0"), entry_id("t1"), entry_id("t2", "c0ffee")]
    for i, entry in enumerate(entries):
        header: dict[str, Any] = {
            HEADER: WaitState(deferrals=1, since=now - 5_000_000, entry=entry).to_header()}
        message = capture(job.signature((i,), task_id=f"t{i}", headers=header)).dumps()
        assert room.enqueue(entry, message, f"t{i}", limits=[limit], blocking=limit,
                            place_us=now + i, due_us=now + 60_000_000)
    assert runtime.gate.client.hgetall(room.notes) == {
        key_digest("t2").encode(): b"@" + entries[2].encode()}
    note = read_wait(runtime, "t1")
    assert note is not None
    assert (note["task"], note["limit"], note["place"]) == ("proj.in_line", "line", 1)
    note = read_wait(runtime, "t2")
    assert note is not None
    assert (note["task"], note["limit"], note["place"], note["deferrals"]) == \
        ("proj.in_line", "line", 2, 1)
    assert note["booked"] is False
    assert 1.4 < note["due_in_s"] <= 1.5  # third in line at 2/s
    assert 4.9 < note["waiting_s"] < 6.0
    runtime.live.set("line", "20/s")  # the rate the dispatch now charges it at
    note = read_wait(runtime, "t2")
    assert note is not None
    assert 0.1 < note["due_in_s"] <= 0.15
    room.lines.clear()  # (as a dispatch takes it out of its line)
    assert read_wait(runtime, "t2") is None
    assert read_wait(runtime, "t1") is None


def test_store_errors_are_counted(app: Celery) -> None:
    """A decision the store fails counts once per limit of the call."""
    app.conf.throttle_redis_url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    app.conf.throttle_on_error = "allow"
    forget(app)

    @throttled("1/s", name="down")
    @app.task(bind=True, shared=False)
    def job(self: Task[Any, Any]) -> str:
        return "ran"

    metrics.reset()
    job.push_request(id="t", called_directly=False, delivery_info={}, headers=None)
    try:
        assert job.run() == "ran"
    finally:
        job.pop_request()
    assert metrics.snapshot()["down"]["store_errors"] == 1


def test_rate_change_keeps_state_and_never_bursts(client: redis.Redis, prefix: str) -> None:
    """A limit's rate changed in code: the bucket is kept, no burst; bookings keep their
    booked starts."""
    clock = StepClock()
    gate = Gate(client, prefix=prefix, clock=clock)
    old = Limit("api", parse_rate("10/s"))
    assert gate.acquire_many([old]).allowed
    booked = [gate.acquire_many([old], reserve=60) for _ in range(5)]  # starts 0.1 .. 0.5 s
    assert [d.retry_after for d in booked] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    faster = Limit("api", parse_rate("100/s"))
    # Workers restarted with 100/s: a new task queues behind the existing
    # bookings (the bucket's TAT, 0.6 s ahead), then the new spacing applies.
    assert gate.inspect(faster).next_free == pytest.approx(0.6)
    after = gate.acquire_many([faster], reserve=60)
    assert after.retry_after == pytest.approx(0.6)
    slower = Limit("api", parse_rate("1/s"))
    later = gate.acquire_many([slower], reserve=60)
    assert later.retry_after == pytest.approx(0.61)  # behind it; then 1 s apart
    assert gate.acquire_many([slower], reserve=60).retry_after == pytest.approx(1.61)
    # A booking claimed at its booked start under the new rate is honoured if the
    # bucket still holds it, else it re-books: never two starts in one booked start.
    clock.us = T0 + 100_000
    claim = gate.acquire_many([slower], claim=booked[0].reservation, grace=0.02)
    assert (claim.allowed, claim.retry_after) == (True, 0.0)  # the bucket still holds it
    # ... and it is the only start there: a newcomer at that instant waits
    # behind every booking (the last, 1.61 s, plus one interval at 1/s).
    newcomer = gate.acquire_many([slower])
    assert not newcomer.allowed
    assert newcomer.retry_after == pytest.approx(1.61 + 1.0 - 0.1)


def test_lowered_rate_voids_bookings_made_at_the_old_pace(app: Celery) -> None:
    """Booked at 10/s, arriving after a restart at 1/s: not started at the old pace."""
    published: list[dict[str, Any]] = []

    def make(rate: str) -> Task[Any, Any]:
        @throttled(rate, name="api")
        @app.task(bind=True, shared=False, name=f"job_{rate.replace('/', '_per_')}")
        def job(self: Task[Any, Any]) -> str:
            return "ran"

        job.signature_from_request = lambda request, **options: PublishRecorder(published, options)  # type: ignore[method-assign,assignment]
        return job

    def run(task: Task[Any, Any], headers: dict[str, Any] | None, task_id: str) -> str:
        task.push_request(id=task_id, called_directly=False, delivery_info={}, headers=headers)
        try:
            return str(task.run())
        finally:
            task.pop_request()

    app.conf.throttle_max_sleep = 0  # every wait re-published: each arrival is visible
    app.conf.throttle_waiting_room = False  # ... with a countdown, which the recorder records
    forget(app)
    fast, slow = make("10/s"), make("1/s")
    assert run(fast, None, "t0") == "ran"
    for i in range(1, 4):
        with pytest.raises(Ignore):
            run(fast, None, f"t{i}")  # booked 0.1, 0.2 and 0.3 s after the first start
    booked = list(published)
    started = time.monotonic()
    waits = []
    for i, message in enumerate(booked, 1):  # workers restarted at 1/s; each copy arrives
        time.sleep(max(0.0, message["countdown"] - (time.monotonic() - started)))
        with pytest.raises(Ignore):  # honouring the booking would start it at the old pace
            run(slow, message["headers"], f"t{i}")
        waits.append(published[-1]["countdown"])
    # They queue behind the old bucket (0.4 s after the first start), 1 s apart.
    assert waits == pytest.approx([0.3, 1.2, 2.1], abs=0.05)


def test_command_shows_and_resets_concurrency_leases(
    capp: ModuleType, records: redis.Redis, redis_base: str
) -> None:
    """`status` lists a concurrency limit's held seats and pause; `reset` drops the leases."""
    gate = Gate.from_url(f"{redis_base}/{databases.STORE}")  # the test app's store, default prefix
    one = Concurrency("one-seat", 1)
    assert gate.acquire_many([one], holder="task-1").allowed
    gate.pause([one], 30)
    status = throttle_cli(["status", "--json", "one-seat"], redis_base)
    table = throttle_cli(["status", "one-seat"], redis_base)
    reset = throttle_cli(["reset", "one-seat"], redis_base)
    for done in (status, table, reset):
        assert done.returncode == 0, done.stderr
    (row,) = json.loads(status.stdout)["limits"]
    assert (row["limit"], row["concurrency"], row["held"]) == ("one-seat", 1, 1)
    assert 25 <= row["paused_s"] <= 30
    assert re.search(r"^one-seat\s+1 at once\s+-\s+1/1 held\s+paused \d+\.\d{3}s "
                     r"after a provider's 429\s+-\s+tests.celery_app.one_seat$", table.stdout,
                     flags=re.MULTILINE), table.stdout
    assert "leases reset" in reset.stdout
    assert gate.inspect_leases(one).held == 0
    gate.client.close()


def test_command_shows_a_limit_held_back_by_the_provider_s_headers(
    capp: ModuleType, redis_base: str
) -> None:
    """`status` says when a provider's report holds a limit below its rate, and why: what the
    provider said was left, and until when."""
    gate = Gate.from_url(f"{redis_base}/{databases.STORE}")  # the test app's store, default prefix
    sdk = Limit("sdk-requests", parse_rate("9/s"))
    gate.reset(sdk)
    try:
        assert gate.follow([sdk], remaining=3, reset=30.0) == 1
        status = throttle_cli(["status", "--json", "sdk-requests"], redis_base)
        table = throttle_cli(["status", "sdk-requests"], redis_base)
        for done in (status, table):
            assert done.returncode == 0, done.stderr
        (row,) = json.loads(status.stdout)["limits"]
        held = row["held_by_provider"]
        assert held["remaining"] == 3
        assert 25 <= held["until_reset_s"] <= 30
        assert 0 <= held["reported_s_ago"] < 5
        assert 25 <= row["next_free_s"] <= 30
        assert re.search(r"^sdk-requests\s+9/s\s+1\s+\d+%\s+in \d+\.\d{3}s \(held: the provider "
                         r"reported 3 left until its reset in \d+\.\ds\)", table.stdout,
                         flags=re.MULTILINE), table.stdout
    finally:
        gate.reset(sdk)
        gate.client.close()


def test_command_with_the_store_down_says_so_in_one_line(redis_base: str) -> None:
    """No traceback: one line naming the store (password masked) and the setting; exit 1."""
    port = free_port()  # nothing listens there
    env = {**os.environ, **app_env(redis_base,
                                   {"throttle_redis_url": f"redis://:s3cret@127.0.0.1:{port}/0"})}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.celery_app", "throttle",
                           "status"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=ROOT, check=False)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"redis://:**@127.0.0.1:{port}/0" in lines[0]
    assert "throttle_redis_url" in lines[0]
    assert "s3cret" not in done.stderr + done.stdout


def test_a_stopped_limit_is_a_gauge_an_alert_can_use_declared_or_not(app: Celery) -> None:
    """A limit stopped because the money is spent (here one only a gated client uses) is 1 in
    celery_throttle_stopped with its reason until resumed, then gone."""
    from prometheus_client import CollectorRegistry, generate_latest

    from celery_throttle.integration.exporter import FillCollector

    limit = Limit("gated-only", parse_rate("5/s"))
    gate = runtime_for(app).gate
    assert gate.stop([limit], "money", "You exceeded your current quota")
    own = CollectorRegistry()
    own.register(FillCollector(app))
    line = 'celery_throttle_stopped{limit="gated-only",reason="money"} 1.0'
    assert line in generate_latest(own).decode().splitlines()
    gate.resume([limit])
    assert "celery_throttle_stopped{" not in generate_latest(own).decode()


def test_the_grafana_dashboard_reads_only_metrics_the_exporter_serves(app: Celery) -> None:
    """docs/grafana/celery-throttle.json: every metric its queries read is one a worker's
    endpoint serves (metrics.py's counters, each counted once here, and the gauges the
    collector reads from a real Redis at scrape time, in prometheus_client's own text
    format), and it has a panel for each thing a team watches."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    from celery_throttle.integration.exporter import FillCollector

    @throttled("5/s", name="dash-rate", concurrency=2)
    @app.task(shared=False, name="proj.dash")
    def job() -> None:
        return None

    for count in (metrics.admitted, metrics.store_error, metrics.provider_paused):
        count(["dash-rate"])
    metrics.deferred("dash-rate", 1.5)
    metrics.would_defer("dash-rate", 2.5)  # (as a limit in shadow mode counts)
    limit = Limit("dash-rate", parse_rate("5/s"))  # one task in its line
    runtime = runtime_for(app)
    runtime.room.lines.enqueue(entry_id("t-dash"), b"\x01m", "t-dash", limits=[limit],
                                blocking=limit, place_us=1)
    runtime.gate.pause([limit], 30.0)  # as a provider's 429 does
    own = CollectorRegistry()
    own.register(FillCollector(app))
    text = (generate_latest(REGISTRY) + generate_latest(own)).decode()
    served = set(re.findall(r"^(celery_throttle_\w+)(?:\{| )", text, flags=re.MULTILINE))
    pause = re.search(r'^celery_throttle_paused_seconds\{limit="dash-rate"\} (\S+)$', text,
                      flags=re.MULTILINE)
    assert pause is not None
    assert 29 < float(pause.group(1)) <= 30
    dashboard = json.loads((ROOT / "docs" / "grafana" / "celery-throttle.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    read = {name for expr in exprs for name in re.findall(r"celery_throttle_\w+", expr)}
    assert read, "no queries found"
    assert read <= served, f"read but not served: {sorted(read - served)}"
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Starts per second", "Deferrals per second", "Tasks waiting in line",
            "Provider 429 pauses", "Store errors per second"} <= titles
    # Every metric the endpoint serves is on a panel (a new one must be added there too).
    bases = {re.sub(r"_(total|bucket|count|sum|created)$", "", name) for name in served}
    shown = {re.sub(r"_(total|bucket|count|sum|created)$", "", name) for name in read}
    assert bases <= shown, f"served but on no panel: {sorted(bases - shown)}"


def test_the_grafana_dashboards_queries_parse_as_promql(tmp_path: Path) -> None:
    """Prometheus's own parser (promtool, Debian's `prometheus` package) reads every query
    of the dashboard, Grafana's variables given values."""
    promtool = shutil.which("promtool")
    if promtool is None:
        reason = ("promtool is not installed: `apt-get install prometheus` (as .ci/run does) "
                  "checks the Grafana dashboard's queries")
        if REQUIRE_SERVERS:
            pytest.fail(reason)
        pytest.skip(reason)
    dashboard = json.loads((ROOT / "docs" / "grafana" / "celery-throttle.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}",
         "expr": e.replace("$__rate_interval", "1m").replace("$limit", ".*")}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # (YAML reads JSON)
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout
