"""Real Celery worker processes for integration tests, started and always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One `celery worker` node (its own process group), logging to a temp file."""

    def __init__(self, redis_base: str, name: str, *, pool: str = "prefork",
                 concurrency: int = 4, queues: str = "celery,ext,bursty",
                 app: str = "tests.celery_app", env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"ct-{name}-", suffix=".log")[1])
        args = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
                "-c", str(concurrency), "-n", f"{name}@%h", "-Q", queues, "-l", "INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-f", str(self.log)]
        full_env = {**os.environ, "CT_REDIS": redis_base, "PYTHONPATH": str(ROOT),
                    **(env or {})}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the worker logs 'ready' (bounded); fail with its log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready." in self.log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready:\n{self.log.read_text()[-4000:]}")

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL the whole process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL the node and its children at once, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def log_text(self) -> str:
        """Everything the worker logged so far."""
        return self.log.read_text(errors="replace")


class Cluster:
    """Several worker nodes started together; use as a context manager."""

    def __init__(self, redis_base: str, names: Iterable[str] = ("w1", "w2"),
                 **options: Any) -> None:
        self.workers = [Worker(redis_base, n, **options) for n in names]

    def __enter__(self) -> Cluster:
        try:
            for w in self.workers:
                w.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            w.stop()
        for w in self.workers:
            w.log.unlink(missing_ok=True)

    def logs(self) -> str:
        """All nodes' logs, concatenated."""
        return "\n".join(w.log_text() for w in self.workers)


def read_records(client: redis.Redis, *, expect: int, timeout: float) -> list[dict[str, Any]]:
    """Wait (bounded) until ``expect`` start records exist, then return them sorted by time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and client.llen("records") < expect:
        time.sleep(0.1)
    rows = [json.loads(r) for r in client.lrange("records", 0, -1)]
    return sorted(rows, key=lambda r: r["t"])


def max_in_window(times: list[float], window: float) -> int:
    """The largest number of ``times`` in any half-open window [t, t + window)."""
    best, j = 0, 0
    ordered = sorted(times)
    for i in range(len(ordered)):
        while ordered[i] - ordered[j] >= window:
            j += 1
        best = max(best, i - j + 1)
    return best
