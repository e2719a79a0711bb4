"""A mock LLM provider: a real HTTP server on 127.0.0.1 that enforces a strict quota.

At most ``limit`` requests are accepted in any sliding window of ``window``
seconds, counted across all clients; beyond it the answer is HTTP 429 with
``Retry-After`` (whole seconds, as HTTP has it) and ``Retry-After-Ms``.  It
logs the time of every accepted and refused request for the demo's table and
chart.

    python -m examples.provider --port 8080 --limit 10 --window 1

Endpoints: ``POST /v1/summarize`` (JSON ``{"prompt": ...}``), ``GET /stats``,
``POST /reset``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MockProvider", "RateLimited", "RemoteProvider", "summarize"]


class RateLimited(Exception):
    """The provider answered 429; ``retry_after`` is its Retry-After in seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"429 Too Many Requests, retry after {retry_after:.3f}s")
        self.retry_after = retry_after


def summarize(base_url: str, prompt: str) -> dict[str, Any]:
    """The client side: POST a prompt; raise :class:`RateLimited` on 429."""
    request = urllib.request.Request(
        f"{base_url}/v1/summarize", data=json.dumps({"prompt": prompt}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body: dict[str, Any] = json.load(response)
            return body
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code != 429:
            raise
        raise RateLimited(float(exc.headers.get("Retry-After-Ms") or 1000) / 1000) from None


class MockProvider:
    """The quota-enforcing server; ``start()`` runs it on a background thread."""

    def __init__(self, *, limit: int = 10, window: float = 1.0, latency: float = 0.05,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.limit, self.window, self.latency = limit, window, latency
        self._lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque()
        self.accepted: list[float] = []
        self.refused: list[float] = []
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8080``."""
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> MockProvider:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        """Forget every request seen so far."""
        with self._lock:
            self._recent.clear()
            self.accepted.clear()
            self.refused.clear()

    def admit(self) -> float | None:
        """Count one request: None if accepted, else the seconds until a slot frees."""
        with self._lock:
            now = time.time()
            while self._recent and self._recent[0] <= now - self.window:
                self._recent.popleft()
            if len(self._recent) >= self.limit:
                self.refused.append(now)
                return self._recent[0] + self.window - now
            self._recent.append(now)
            self.accepted.append(now)
            return None

    def stats(self) -> dict[str, Any]:
        """Counts and timestamps of accepted and refused requests."""
        with self._lock:
            return {"limit": self.limit, "window": self.window,
                    "accepted": list(self.accepted), "refused": list(self.refused)}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the demo prints its own summary."""

            def _reply(self, code: int, body: dict[str, Any],
                       headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/stats":
                    self._reply(200, provider.stats())
                else:
                    self._reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b"{}"
                if self.path == "/reset":
                    provider.reset()
                    self._reply(200, {"ok": True})
                    return
                if self.path != "/v1/summarize":
                    self._reply(404, {"error": "not found"})
                    return
                wait = provider.admit()
                if wait is not None:
                    self._reply(429, {"error": "rate limit exceeded"}, {
                        "Retry-After": str(max(1, math.ceil(wait))),
                        "Retry-After-Ms": str(max(1, math.ceil(wait * 1000))),
                    })
                    return
                prompt = str(json.loads(raw or b"{}").get("prompt", ""))
                time.sleep(provider.latency)  # the model "thinking"
                tokens = max(1, len(prompt) // 4)
                self._reply(200, {"summary": prompt[:20], "usage": {"total_tokens": tokens}})

        return Handler


class RemoteProvider:
    """A running provider reached over HTTP (docker-compose): the same reset/stats calls."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def reset(self) -> None:
        """Forget every request seen so far."""
        request = urllib.request.Request(f"{self.url}/reset", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stats(self) -> dict[str, Any]:
        """Counts and timestamps of accepted and refused requests."""
        with urllib.request.urlopen(f"{self.url}/stats", timeout=10) as response:
            data: dict[str, Any] = json.load(response)
            return data


def main() -> None:
    """Run the provider in the foreground (for docker-compose or by hand)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--window", type=float, default=1.0)
    args = parser.parse_args()
    provider = MockProvider(limit=args.limit, window=args.window, host=args.host, port=args.port)
    print(f"mock provider on {provider.url}: {args.limit} requests per {args.window}s", flush=True)
    try:
        provider.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        provider.server.server_close()


if __name__ == "__main__":
    main()
