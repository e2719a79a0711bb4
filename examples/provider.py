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
under load does (the test of 429 feedback).  ``answer_with(kind)`` gives the
next requests (a count, or for a while) an answer that is not the quota's:
the provider overloaded (Anthropic's 529, OpenAI's 503), an account out of
money (OpenAI's 429 ``insufficient_quota``, Anthropic's spend-cap 429 and its
usage-limit 400), or a bare 429 with no headers at all, as a proxy sends
it (:data:`ANSWERS`).  ``set_limit()`` changes the quota while it serves,
``rate_headers=False`` leaves every rate-limit header out, as most SaaS APIs
and proxies do, and ``retry_after=False`` the wait of its own 429s too.  It
logs every accepted and refused request for the demo's table and chart.

    python -m examples.provider --port 8080 --limit 10 --window 1

Endpoints: ``POST /v1/summarize`` (JSON ``{"prompt": ...}``), ``GET /stats``,
``POST /reset``; and, for the official SDKs, ``POST /v1/chat/completions``
(OpenAI's shape and its ``x-ratelimit-*`` headers, ``openai.OpenAI(base_url=
provider.url + "/v1")``) and ``POST /v1/messages`` (Anthropic's, with its
``anthropic-ratelimit-*`` headers, ``anthropic.Anthropic(base_url=provider.url)``).
Every 429 carries the provider's own ``retry-after`` and ``retry-after-ms``
(unless ``retry_after=False``);
``refusals`` records why each was refused: ``"hold"`` (:meth:`MockProvider.hold`,
the provider's own trouble) or a quota (``"requests"``, ``"inflight"``,
``"tokens"``), the 429s a client's pacing is to blame for.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ANSWERS", "MockProvider", "RateLimited", "RemoteProvider", "summarize"]

#: The answers :meth:`MockProvider.answer_with` gives on demand, as the providers give
#: them (bodies as recorded from their APIs, trimmed): kind -> (status, body), the body a
#: dict, or None for a plain-text one; "overloaded" has one per endpoint shape.
ANSWERS: dict[str, dict[str, tuple[int, dict[str, Any] | None]]] = {
    "overloaded": {
        "/v1/messages": (529, {"type": "error", "error": {"type": "overloaded_error",
                                                          "message": "Overloaded"}}),
        "/v1/chat/completions": (503, {"error": {
            "message": "The server is overloaded or not ready yet.", "type": "server_error",
            "param": None, "code": None}}),
        "": (503, {"error": "overloaded"}),
    },
    "insufficient_quota": {"": (429, {"error": {
        "message": "You exceeded your current quota, please check your plan and billing "
                   "details.", "type": "insufficient_quota", "param": None,
        "code": "insufficient_quota"}})},
    "spend_cap": {"": (429, {"type": "error", "error": {
        "type": "rate_limit_error",
        "message": "This request would exceed your organization's monthly usage limit. "
                   "Please go to Plans & Billing to raise it."}})},
    "usage_limit": {"": (400, {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "You have reached your specified API usage limits. You will regain "
                   "access on 2027-01-01 at 00:00 UTC."}})},
    "bare": {"": (429, None)},
}


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
                 token_window: float = 60.0, bucket: bool = False, host: str = "127.0.0.1",
                 port: int = 0, rate_headers: bool = True, retry_after: bool = True) -> None:
        self.limit, self.window, self.latency = limit, window, latency
        self.rate_headers = rate_headers  # False: no x-ratelimit-*/anthropic-ratelimit-*
        self.retry_after = retry_after  # False: its 429s name no wait (a bare 429)
        # answer_with(): (kind, requests left to answer so, or None; until, time.time())
        self._forced: tuple[str, int | None, float] | None = None
        # bucket=True: the request quota is a token bucket of `limit` refilled at
        # limit/window per second (OpenAI's and Anthropic's own model), instead of
        # a sliding window; the headers report it the same way either way.
        self.bucket = bucket
        self._level, self._level_at = float(limit), time.time()
        self.overflow = 0.0
        self.log: list[tuple[float, str, bool]] = []  # (when, path, accepted)
        self.max_inflight, self.token_budget, self.token_window = (
            max_inflight, token_budget, token_window)
        self._lock = threading.Lock()
        self._recent: collections.deque[float] = collections.deque()
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._inflight = 0
        self._held_until = 0.0
        self.accepted: list[float] = []
        self.refused: list[float] = []
        self.refusals: list[tuple[float, str]] = []  # (when, why): "hold" or the quota
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
            self.refusals.clear()
            self.log.clear()
            self._level, self._level_at = float(self.limit), time.time()
            self.overflow = 0.0
            self.calls.clear()
            self.most_inflight = 0
            self._held_until = 0.0

    def set_limit(self, limit: int, window: float | None = None) -> None:
        """Change the request quota while serving (a provider's tier moving)."""
        if limit < 1 or (window is not None and window <= 0):
            raise ValueError(f"a quota of {limit} requests per {window} s")
        with self._lock:
            self._refill(time.time())
            self.limit = limit
            self.window = self.window if window is None else window
            self._level = min(self._level, float(limit))

    def answer_with(self, kind: str | None, *, count: int | None = None,
                    seconds: float | None = None) -> None:
        """Answer requests with ``kind`` (:data:`ANSWERS`) instead of deciding them: the next
        ``count`` of them, or all for ``seconds`` (one of the two); None: decide again."""
        if kind is None:
            with self._lock:
                self._forced = None
            return
        if kind not in ANSWERS:
            raise ValueError(f"unknown answer {kind!r}: expected one of {sorted(ANSWERS)}")
        if (count is None) == (seconds is None):
            raise ValueError("answer_with: give count or seconds, one of them")
        until = time.time() + seconds if seconds is not None else math.inf
        with self._lock:
            self._forced = (kind, count, until)

    def forced(self, path: str) -> tuple[int, dict[str, Any] | None, str] | None:
        """The answer :meth:`answer_with` gives this request (status, body, kind), if any;
        it is counted as a refusal of that kind."""
        with self._lock:
            if self._forced is None:
                return None
            kind, left, until = self._forced
            now = time.time()
            if now >= until:
                self._forced = None
                return None
            if left is not None:
                self._forced = (kind, left - 1, until) if left > 1 else None
            self.log.append((now, path, False))
            self.refused.append(now)
            self.refusals.append((now, kind))
        answers = ANSWERS[kind]
        status, body = answers.get(path) or answers[""]
        return status, body, kind

    def hold(self, seconds: float) -> None:
        """Refuse every request for ``seconds`` from now (429, Retry-After: the rest)."""
        with self._lock:
            self._held_until = time.time() + seconds

    def admit(self, tokens: int = 0) -> float | None:
        """Count one request: None if accepted, else the seconds until it could be."""
        return self.decide(tokens)[0]

    def _refill(self, now: float) -> None:
        rate = self.limit / self.window
        level = self._level + (now - self._level_at) * rate
        self.overflow += max(0.0, level - self.limit)
        self._level, self._level_at = min(float(self.limit), level), now

    def wasted(self) -> float:
        """bucket=True: requests the quota gave that nobody took (refill past a full bucket)."""
        with self._lock:
            self._refill(time.time())
            return self.overflow

    def decide(self, tokens: int = 0, path: str = "") -> tuple[float | None, str]:
        """Count one request: (None, "") if accepted, else (seconds until it could be, why)."""
        with self._lock:
            now = time.time()
            while self._recent and self._recent[0] <= now - self.window:
                self._recent.popleft()
            while self._tokens and self._tokens[0][0] <= now - self.token_window:
                self._tokens.popleft()
            self._refill(now)
            wait, why = None, ""
            if now < self._held_until:
                wait, why = self._held_until - now, "hold"
            elif self.bucket and self._level < 1:
                wait, why = (1 - self._level) * self.window / self.limit, "requests"
            elif not self.bucket and len(self._recent) >= self.limit:
                wait, why = self._recent[0] + self.window - now, "requests"
            elif self.max_inflight is not None and self._inflight >= self.max_inflight:
                wait, why = self.latency, "inflight"
            elif self.token_budget is not None and (
                    sum(n for _, n in self._tokens) + tokens > self.token_budget):
                wait = self._tokens[0][0] + self.token_window - now if self._tokens else 1.0
                why = "tokens"
            self.log.append((now, path, wait is None))
            if wait is not None:
                self.refused.append(now)
                self.refusals.append((now, why))
                return wait, why
            self._level -= 1
            self._recent.append(now)
            self._tokens.append((now, tokens))
            self.accepted.append(now)
            self._inflight += 1
            self.most_inflight = max(self.most_inflight, self._inflight)
            return None, ""

    def quota_refusals(self) -> int:
        """The 429s a client's pacing caused (every refusal but the provider's own holds)."""
        with self._lock:
            return sum(1 for _, why in self.refusals if why != "hold")

    def remaining(self) -> tuple[int, float]:
        """(requests left now, seconds until the reset), as the headers say.

        bucket=True (the providers' own model): the reset is when the bucket is
        full again.  A sliding window frees one request as each one leaves it:
        its reset is when the oldest leaves (a window's "full again" would claim
        the requests freed before it were not there).
        """
        with self._lock:
            now = time.time()
            if self.bucket:
                self._refill(now)
                return int(self._level), (self.limit - self._level) * self.window / self.limit
            recent = [t for t in self._recent if t > now - self.window]
            reset = recent[0] + self.window - now if recent else 0.0
            return max(0, self.limit - len(recent)), max(0.0, reset)

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

            def _reply(self, code: int, body: dict[str, Any] | None,
                       headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode() if body is not None else b"Too Many Requests"
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if body is not None
                                 else "text/plain")
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
                shape = _SHAPES.get(self.path)
                if shape is None:
                    self._reply(404, {"error": "not found"})
                    return
                forced = provider.forced(self.path)
                if forced is not None:
                    status, answer, _ = forced
                    self._reply(status, answer)
                    return
                body = json.loads(raw or b"{}")
                prompt = shape.prompt(body)
                tokens = max(1, len(prompt) // 4)
                start = time.time()
                wait, why = provider.decide(tokens, self.path)
                limits = shape.headers(provider) if provider.rate_headers else {}
                if wait is not None:
                    self._reply(429, shape.refusal(why), {**limits, **({
                        "Retry-After": str(max(1, math.ceil(wait))),
                        "Retry-After-Ms": str(max(1, math.ceil(wait * 1000))),
                    } if provider.retry_after else {})})
                    return
                try:
                    # The model "thinking"; a client may ask for longer (bounded).
                    time.sleep(min(30.0, float(body.get("work") or provider.latency)))
                finally:
                    # Out of flight before the answer leaves: a client that
                    # reads it may start its next call at once.
                    provider.done(start, tokens)
                self._reply(200, shape.answer(prompt, tokens),
                            shape.headers(provider) if provider.rate_headers else None)

        return Handler


class _Shape:
    """One endpoint's request and answer: the plain one (``/v1/summarize``)."""

    @staticmethod
    def prompt(body: dict[str, Any]) -> str:
        return str(body.get("prompt", ""))

    @staticmethod
    def answer(prompt: str, tokens: int) -> dict[str, Any]:
        return {"summary": prompt[:20], "usage": {"total_tokens": tokens}}

    @staticmethod
    def refusal(why: str) -> dict[str, Any]:
        return {"error": "rate limit exceeded"}

    @staticmethod
    def headers(provider: MockProvider) -> dict[str, str]:
        return {}


def _messages_text(body: dict[str, Any]) -> str:
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content", "")
        if isinstance(content, list):  # content blocks
            content = " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
        parts.append(str(content))
    return " ".join(parts)


def _openai_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"6m0s"``, ``"1s"``, ``"293ms"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


class _OpenAI(_Shape):
    """``POST /v1/chat/completions`` as OpenAI answers it."""

    prompt = staticmethod(_messages_text)

    @staticmethod
    def answer(prompt: str, tokens: int) -> dict[str, Any]:
        return {"id": "chatcmpl-mock", "object": "chat.completion", "created": int(time.time()),
                "model": "mock", "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant",
                                                          "content": prompt[:20]}}],
                "usage": {"prompt_tokens": tokens, "completion_tokens": 1,
                          "total_tokens": tokens + 1}}

    @staticmethod
    def refusal(why: str) -> dict[str, Any]:
        return {"error": {"message": f"Rate limit reached ({why})", "type": why,
                          "param": None, "code": "rate_limit_exceeded"}}

    @staticmethod
    def headers(provider: MockProvider) -> dict[str, str]:
        left, reset = provider.remaining()
        return {"x-ratelimit-limit-requests": str(provider.limit),
                "x-ratelimit-remaining-requests": str(left),
                "x-ratelimit-reset-requests": _openai_duration(reset)}


class _Anthropic(_Shape):
    """``POST /v1/messages`` as Anthropic answers it."""

    prompt = staticmethod(_messages_text)

    @staticmethod
    def answer(prompt: str, tokens: int) -> dict[str, Any]:
        return {"id": "msg_mock", "type": "message", "role": "assistant", "model": "mock",
                "content": [{"type": "text", "text": prompt[:20]}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": tokens, "output_tokens": 1}}

    @staticmethod
    def refusal(why: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "rate_limit_error",
                                           "message": f"rate limit exceeded ({why})"}}

    @staticmethod
    def headers(provider: MockProvider) -> dict[str, str]:
        left, reset = provider.remaining()
        at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=reset)
        return {"anthropic-ratelimit-requests-limit": str(provider.limit),
                "anthropic-ratelimit-requests-remaining": str(left),
                "anthropic-ratelimit-requests-reset": at.isoformat(timespec="seconds")}


_SHAPES: dict[str, type[_Shape]] = {"/v1/summarize": _Shape, "/v1/chat/completions": _OpenAI,
                                    "/v1/messages": _Anthropic}


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
