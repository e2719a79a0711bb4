"""The dashboard against live workers: its JSON equals `celery throttle status --json`, and
a real headless Chromium renders the limits, their fill and the tasks waiting, updating."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_throttle.ops.dashboard import TOKEN_ENV

from ..conftest import REQUIRE_SERVERS
from ..workers import ROOT, app_command, throttle_cli, wait_results, worker_nodes

pytestmark = pytest.mark.integration

TOKEN = "e2e-secret-of-the-dashboard"
#: Where the test leaves its screenshot for a person to look at.
SHOT = ROOT / "test-output" / "dashboard.png"


def _chromium() -> str:
    found = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser"))
                  if p), None)
    if found is None:
        reason = "Debian's chromium is not installed (.ci/run installs it)"
        if REQUIRE_SERVERS:
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


@contextlib.contextmanager
def _dashboard(redis_base: str) -> Iterator[str]:
    """`celery -A tests.celery_app throttle dashboard` on a free port, with controls on."""
    with app_command(["throttle", "dashboard"], redis_base, {TOKEN_ENV: TOKEN},
                     what="the dashboard", ready=lambda url: _get(f"{url}/api/meta")) as url:
        yield url


def _render(chromium: str, url: str, shot: Path | None = None) -> str:
    """The page's DOM after about 3 s of its own updates (virtual time), and a screenshot."""
    common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--window-size=1400,1100", "--virtual-time-budget=3000"]
    if shot is not None:
        shot.parent.mkdir(exist_ok=True)
        subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True,
                       timeout=60, check=True)
    done = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout


def _row(dom: str, name: str) -> dict[str, str]:
    """The rendered table row of limit ``name``: its cells' text by field."""
    found = re.search(rf'<tr class="limit" data-limit="{re.escape(name)}"[^>]*>(.*?)</tr>',
                      dom, re.S)
    assert found, f"no row for {name!r} in the page"
    cells = dict(re.findall(r'<td data-field="(\w+)"[^>]*>(.*?)</td>', found.group(1), re.S))
    waiting = re.search(r'data-waiting="(\d+)"', found.group(1))
    text = {k: re.sub(r"<[^>]+>", " ", v) for k, v in cells.items()}
    return {**text, "waiting_n": waiting.group(1) if waiting else ""}


def _waiting(row: dict[str, Any]) -> int:
    return int(row.get("in_line", 0)) + int(row.get("booked_ahead", 0))


def test_the_page_shows_every_limit_and_follows_live_workers(
        capp: ModuleType, records: redis.Redis, redis_base: str) -> None:
    """Idle, then 12 tasks behind 1/s: the page's fill and waiting count follow, the JSON
    equals `status --json`, and the page's controls (with the secret) pause the limit and
    purge its waiting tasks, not those of another limit."""
    chromium = _chromium()
    with worker_nodes(redis_base, ("w1",), concurrency=2), _dashboard(redis_base) as url:
        idle = _render(chromium, url)
        assert int(re.search(r'data-updates="(\d+)"', idle).group(1)) >= 2  # type: ignore[union-attr]
        row = _row(idle, "patient")
        assert "0%" in row["fill"]
        assert row["waiting_n"] == "0"
        results = [capp.patient.delay(i) for i in range(12)]
        others = [capp.long_wait.delay(i) for i in range(6)]  # 1 per 2 s: they wait too
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            web = next(r for r in _get(f"{url}/api/status")["limits"] if r["limit"] == "patient")
            if _waiting(web) >= 6:
                break
            time.sleep(0.2)
        assert _waiting(web) >= 6, web
        # Held still by a pause (through the page's API), the two readings can be compared.
        assert _post(f"{url}/api/limits/patient/pause", {"seconds": 120})["paused_s"] == 120
        time.sleep(0.5)  # (a task already admitted may still be starting)
        web_doc = _get(f"{url}/api/status")
        cli = throttle_cli(["status", "--json", "patient"], redis_base)
        assert cli.returncode == 0, cli.stderr
        (cli_row,) = json.loads(cli.stdout)["limits"]
        web_row = next(r for r in web_doc["limits"] if r["limit"] == "patient")
        moving = {"next_free_s", "ttl_s", "paused_s", "used", "fill", "drains_in_s"}
        assert {k: v for k, v in web_row.items() if k not in moving} == \
            {k: v for k, v in cli_row.items() if k not in moving}
        assert abs(web_row["paused_s"] - cli_row["paused_s"]) < 5
        assert web_row["paused_by"] == "operator"
        busy = _render(chromium, url, SHOT)
        row = _row(busy, "patient")
        assert int(row["waiting_n"]) == _waiting(web_row)
        assert "paused" in row["next"]
        assert "by an operator" in row["next"]
        assert re.search(r'data-chart="patient:tasks waiting"', busy)
        assert SHOT.stat().st_size > 10_000
        # The page's purge of one limit: its waiting tasks are revoked, the other's stay.
        revoked = _post(f"{url}/api/limits/patient/purge", {"confirm": "patient"})["revoked"]
        # In line and parked, not a task asleep in the worker for its near booked start.
        assert web_row.get("in_line", 0) <= revoked <= _waiting(web_row)
        assert _post(f"{url}/api/limits/patient/resume", {})["resumed"] is True
        states = wait_results(results, timeout=20)
        assert states.count("REVOKED") == revoked, states
        assert states.count("SUCCESS") == 12 - revoked, states
        # Pages share a read up to one sampling period (1 s) old, plus the read's own
        # time: a read taken before the last task left the line may still be served.
        deadline = time.monotonic() + 5
        while True:
            rows = {r["limit"]: r for r in _get(f"{url}/api/status")["limits"]}
            if rows["patient"].get("in_line", 0) == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert rows["patient"].get("in_line", 0) == 0
        assert rows["patient"]["paused_s"] == 0
        assert _waiting(rows["hops"]) >= 1  # the other limit's tasks still wait
        assert "REVOKED" not in wait_results(others, timeout=0.1)
