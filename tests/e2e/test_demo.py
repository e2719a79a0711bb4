"""The demo end to end on the embedded Redis, scaled down: ours gets no 429, a chart is drawn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_demo_runs_and_reports(tmp_path: Path, redis_url: str) -> None:
    """`python -m examples.demo` finishes, prints the table and saves the chart."""
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--tasks", "30", "--timeout", "20",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours = next(line for line in done.stdout.splitlines() if line.startswith("celery_throttle "))
    cells = ours.split()
    assert cells[1] == "0"  # no 429 for ours
    assert cells[-1] == "30/30"
    assert any(line.startswith("celery rate_limit ") for line in done.stdout.splitlines())
    assert (tmp_path / "demo.png").stat().st_size > 10_000
