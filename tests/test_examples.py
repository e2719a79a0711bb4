"""Each example runs end to end on the embedded Redis and reports success."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("example", ["examples.llm_quota", "examples.external_api"])
def test_example_runs(example: str, redis_url: str) -> None:
    """`python -m <example>` exits 0: its own checks (no 429, limits kept) passed."""
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", example], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
