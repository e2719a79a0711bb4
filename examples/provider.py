"""A mock LLM provider: a real HTTP server on 127.0.0.1 that enforces strict quotas.

Like a real LLM API it enforces up to three quotas, each counted across all
clients, and answers HTTP 429 with ``Retry-After`` (whole seconds, as HTTP
has it) and ``Retry-After-Ms`` beyond any of them:

* at most ``limit`` requests in any sliding window of ``window`` seconds;
* at most ``max_inflight`` requests in flight at once (None: no cap);
* at most ``token_budget`` tokens in any sliding window of ``token_window``
  seconds (None: no budget), a request's tokens being len(prompt) // 4,
  known to the client only from the response's ``usage``.

``hold(seconds)`` makes it refuse everything for a while, as a provider
under load does (the test of 429 feedback).  It logs every accepted and
refused request for the demo's table and chart.

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


def summarize(base_url: str, prompt: str, work: float | None = None) -> dict[str, Any]:
    """The client side: POST a prompt; raise :class:`RateLimited` on 429.

    ``work``: seconds the provider takes to answer (default: its latency).
    """
    payload: dict[str, Any] = {"prompt": prompt}
    if work is not None:
        payload["work"] = work
    request = urllib.request.Request(
        f"{base_url}/v1/summarize", data=json.dumps(payload).encode(),
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
                 max_inflight: int | None = None, token_budget: int | None = None,
                 token_window: float = 60.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.limit, self.window, self.latency = limit, window, latency
        self.max_inflight, self.token_budget, self.token_window = (
            max_inflight, token_budget, token_window)
        self._lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque()
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._inflight = 0
        self._held_until = 0.0
        self.accepted: list[float] = []
        self.refused: list[float] = []
        self.calls: list[tuple[float, float, int]] = []  # accepted: (start, end, tokens)
        self.most_inflight = 0
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
            self._tokens.clear()
            self.accepted.clear()
            self.refused.clear()
            self.calls.clear()
            self.most_inflight = 0
            self._held_until = 0.0

    def hold(self, seconds: float) -> None:
        """Refuse every request for ``seconds`` from now (429, Retry-After: the rest)."""
        with self._lock:
            self._held_until = time.time() + seconds

    def admit(self, tokens: int = 0) -> float | None:
        """Count one request: None if accepted, else the seconds until it could be."""
        with self._lock:
            now = time.time()
            while self._recent and self._recent[0] <= now - self.window:
                self._recent.popleft()
            while self._tokens and self._tokens[0][0] <= now - self.token_window:
                self._tokens.popleft()
            wait = None
            if now < self._held_until:
                wait = self._held_until - now
            elif len(self._recent) >= self.limit:
                wait = self._recent[0] + self.window - now
            elif self.max_inflight is not None and self._inflight >= self.max_inflight:
                wait = self.latency
            elif self.token_budget is not None and (
                    sum(n for _, n in self._tokens) + tokens > self.token_budget):
                wait = self._tokens[0][0] + self.token_window - now if self._tokens else 1.0
            if wait is not None:
                self.refused.append(now)
                return wait
            self._recent.append(now)
            self._tokens.append((now, tokens))
            self.accepted.append(now)
            self._inflight += 1
            self.most_inflight = max(self.most_inflight, self._inflight)
            return None

    def done(self, start: float, tokens: int) -> None:
        """An accepted request has been answered."""
        with self._lock:
            self._inflight -= 1
            self.calls.append((start, time.time(), tokens))

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
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    # The client gave up (a demo run stopped at its timeout):
                    # nothing to answer, and no traceback in the user's output.
                    self.close_connection = True

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
                body = json.loads(raw or b"{}")
                prompt = str(body.get("prompt", ""))
                tokens = max(1, len(prompt) // 4)
                start = time.time()
                wait = provider.admit(tokens)
                if wait is not None:
                    self._reply(429, {"error": "rate limit exceeded"}, {
                        "Retry-After": str(max(1, math.ceil(wait))),
                        "Retry-After-Ms": str(max(1, math.ceil(wait * 1000))),
                    })
                    return
                try:
                    # The model "thinking"; a client may ask for longer (bounded).
                    time.sleep(min(30.0, float(body.get("work") or provider.latency)))
                finally:
                    # Out of flight before the answer leaves: a client that
                    # reads it may start its next call at once.
                    provider.done(start, tokens)
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
