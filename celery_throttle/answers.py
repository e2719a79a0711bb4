"""What a provider's answer says about calling it again: one reading for every caller.

A refused call means one of three things, and each asks for a different wait:

* **quota**: the caller's own rate or token quota is spent for now (HTTP 429:
  OpenAI's and Anthropic's rate limits, a proxy's or a SaaS API's bare 429).
  It clears within the provider's ``retry-after-ms`` / ``retry-after``
  (1 s when it names none).
* **overloaded**: the provider is busy for everyone, not over this quota
  (Anthropic's 529 ``overloaded_error``, a 503).  Its quota is untouched.
* **money**: the account may spend no more (OpenAI's 429 ``insufficient_quota``;
  Anthropic's spend-cap 429, a ``rate_limit_error`` whose message names a usage
  limit; a 400 that says the usage limits or the credit balance are spent; a
  proxy's ``budget_exceeded``; a 402).  Waiting a second does not clear it.

:func:`classify` reads a status, its headers and its body (bytes, text, or the
JSON already decoded) into an :class:`Answer`, or None for an answer that says
none of these.  A body is read for its error's ``type``, ``code`` and
``message`` in both providers' shapes (``{"error": {...}}`` and
``{"type": "error", "error": {...}}``); the message is matched too, because a
spend cap may carry no code of its own.  A provider's own signals (an HTTP 200
whose JSON says "rate limited") are read by a ``hook``: ``hook(status, headers,
body)`` returns a kind (``"quota"``, ``"overloaded"``, ``"money"``) or None to
leave the answer to the reading here; ``body`` is the decoded JSON, or the text
when it is not JSON, or None.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import (
    DEFAULT_RETRY_AFTER,
    MAX_RETRY_AFTER,
    LimitStopped,
    RateLimited,
    named_retry_after,
    response_of,
    retry_after_of,
    status_of,
)

__all__ = ["KINDS", "MAX_BODY", "OVERLOAD_FIRST", "OVERLOAD_MOST", "Answer", "Backoff", "Hook",
           "Kind", "check_response", "classify"]

Kind = Literal["quota", "overloaded", "money"]
#: The kinds, in the words :func:`classify` and a hook use.
KINDS: tuple[Kind, ...] = ("quota", "overloaded", "money")
#: A hook: (status, headers, body) -> a kind, or None to leave the answer to :func:`classify`.
Hook = Callable[[int, Mapping[str, str], Any], "Kind | None"]
#: The largest body read to classify an answer (bytes); a longer one is not an error's.
MAX_BODY = 64 * 1024
#: The most of a provider's message an :class:`Answer` keeps (characters).
MAX_MESSAGE = 300

#: Error types and codes that say the money is spent (OpenAI's, LiteLLM's).
_MONEY_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached",
                          "billing_not_active", "budget_exceeded"})
#: Messages that say so without a code of their own: Anthropic's spend caps ("...exceed
#: your organization's monthly usage limit", "You have reached your specified API usage
#: limits"), its "credit balance is too low", OpenAI's "exceeded your current quota".
#: Not "billing" alone: OpenAI's ordinary rate-limit message links its billing page.
_MONEY_WORDS = re.compile(r"usage limit|spend(?:ing)? limit|spend cap|credit balance"
                          r"|exceeded your current quota|budget", re.IGNORECASE)
#: The statuses of an overloaded provider.
_OVERLOADED = frozenset({503, 529})
#: An overloaded provider is held off this long (seconds) after its first overloaded answer
#: in a row, twice as long after each next one, at most OVERLOAD_MOST (before the jitter).
OVERLOAD_FIRST, OVERLOAD_MOST = 1.0, 32.0


class Backoff:
    """How long to hold off an overloaded provider: :data:`OVERLOAD_FIRST` seconds, doubled
    with each overloaded answer in a row (this process's count), at most
    :data:`OVERLOAD_MOST`, times a jitter of 1 to 1.25 (callers held off together do not
    come back together), and never less than the provider's own ``retry-after``.  A
    success resets it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_a_row = 0

    def next(self, named: float | None = None) -> float:
        """The hold-off after one more overloaded answer (``named``: its retry-after)."""
        with self._lock:
            self.in_a_row += 1
            steps = self.in_a_row
        wait = min(OVERLOAD_MOST, OVERLOAD_FIRST * 2 ** min(steps - 1, 16))
        jittered: float = wait * random.uniform(1.0, 1.25)
        return min(max(jittered, named or 0.0), MAX_RETRY_AFTER)

    def reset(self) -> None:
        """A success: the next overload starts from :data:`OVERLOAD_FIRST` again."""
        self.in_a_row = 0


#: The back-off of :func:`check_response`'s callers in this process.
_BACKOFF = Backoff()


@dataclass(frozen=True, slots=True)
class Answer:
    """A refused call read for what it means.

    ``kind``: quota, overloaded or money.  ``retry_after``: the seconds the
    provider's headers name (a quota's default: 1 s), None when they name none
    for an overload or a money answer.  ``message``: the provider's own words,
    cut to :data:`MAX_MESSAGE` characters ("" when it gave none).  ``named``:
    the headers named the wait (a quota's default pauses a fixed limit; a
    limit that learns its rate is cut instead, not paused).
    """

    kind: Kind
    retry_after: float | None
    message: str
    named: bool = False


def classify(status: int, headers: Mapping[str, str] | None, body: Any = None,
             hook: Hook | None = None) -> Answer | None:
    """What an answer of ``status`` with ``headers`` and ``body`` means (module docstring);
    None: none of the three (a success, or an error not about the quota).

    ``body``: bytes or text (read as JSON when it is), a decoded JSON value, or
    None.  ``hook``: a provider's own signals, asked first.
    """
    headers = headers or {}
    decoded = _decoded(body)
    kind = hook(status, headers, decoded) if hook is not None else None
    if kind is not None and kind not in KINDS:
        raise ValueError(f"the answers hook returned {kind!r}: expected one of "
                         f"{list(KINDS)} or None")
    code, message = _error_of(decoded)
    if kind is None:
        kind = _kind(status, code, message)
    if kind is None:
        return None
    named = named_retry_after(headers)
    retry_after = (named if named is not None else retry_after_of(headers)) \
        if kind == "quota" else named
    return Answer(kind, retry_after, message[:MAX_MESSAGE], named is not None)


def check_response(response: Any, *, limits: Sequence[str] = (),
                   answers: Hook | None = None) -> None:
    """Raise :class:`~celery_throttle.RateLimited` if ``response`` says the quota is spent
    (else do nothing).

    ``response``: an httpx, httpx2, requests, aiohttp or urllib response
    (``status_code`` or ``status``/``code``, and ``headers``), or an error
    that carries one in ``.response``: the SDKs' ``openai.RateLimitError`` and
    ``anthropic.RateLimitError``, ``httpx.HTTPStatusError``,
    ``requests.HTTPError``.  Its status, headers and body (an SDK error's
    ``body``, else the response's content when it was read) are read by
    :func:`classify` (``answers``: a provider's own signals): a 429 for the
    quota pauses for ``Retry-After-Ms`` / ``Retry-After`` (1 s without); an
    overloaded
    provider's answer raises it with ``overloaded`` (the limits are held off
    for a :class:`Backoff`'s time, their quota untouched; a success resets
    it).  An answer that says the money is spent raises it with ``stop``: the
    limits stop until resumed, and the task waits for that.  An error whose
    causes hold a :class:`~celery_throttle.LimitStopped` (an SDK wraps what a
    gated client raises in its connection error) raises it with ``stop`` too.
    An object with no HTTP status to read raises ``TypeError`` naming its
    type.
    """
    stopped = _stopped_in(response)
    if stopped is not None:
        raise RateLimited(DEFAULT_RETRY_AFTER, limits=limits,
                          stop=stopped.provider_message or stopped.reason)
    found = response_of(response)
    status = status_of(found)
    assert status is not None  # (response_of found one)
    answer = classify(status, getattr(found, "headers", None) or {}, _body_of(response, found),
                      answers)
    if answer is None:
        if 200 <= status < 300:
            _BACKOFF.reset()
        return
    if answer.kind == "overloaded":
        raise RateLimited(_BACKOFF.next(answer.retry_after), limits=limits, overloaded=True)
    raise RateLimited(answer.retry_after if answer.named else None, limits=limits,
                      stop=(answer.message or "money") if answer.kind == "money" else None)


def _stopped_in(given: Any) -> LimitStopped | None:
    """The :class:`~celery_throttle.LimitStopped` among ``given`` and its causes, if any."""
    seen = 0
    while isinstance(given, BaseException) and seen < 8:
        if isinstance(given, LimitStopped):
            return given
        given = given.__cause__ or given.__context__
        seen += 1
    return None


def _body_of(given: Any, response: Any) -> Any:
    """What the answer said: an SDK error's decoded ``body``, else the response's content
    when it is in memory (a stream's is not read here)."""
    body = getattr(given, "body", None)
    if body is not None and not callable(body):
        return body
    for name in ("content", "text"):
        try:
            value = getattr(response, name, None)
        except Exception:  # httpx's ResponseNotRead: a stream, left unread
            continue
        if isinstance(value, bytes | str):
            return value
    return None


def _kind(status: int, code: str, message: str) -> Kind | None:
    money = code in _MONEY_CODES or bool(_MONEY_WORDS.search(message))
    if (status in (400, 403, 429) and money) or status == 402:
        return "money"
    if status == 429:
        return "quota"
    if status in _OVERLOADED:
        return "overloaded"
    return None


def _decoded(body: Any) -> Any:
    """The body as JSON if it is JSON, else its text (or None)."""
    if isinstance(body, bytes | bytearray):
        if len(body) > MAX_BODY:
            return None
        body = bytes(body).decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            return json.loads(body)
        except ValueError:
            return body
    return body


def _error_of(body: Any) -> tuple[str, str]:
    """(the error's type or code, lower case; its message) from both providers' shapes."""
    if not isinstance(body, Mapping):
        return "", body if isinstance(body, str) else ""
    error = body.get("error")
    if isinstance(error, str):
        return error.lower() if error in _MONEY_CODES else "", error
    if not isinstance(error, Mapping):
        return "", str(body.get("message") or "")
    codes = [str(error.get(k) or "").lower() for k in ("code", "type")]
    code = next((c for c in codes if c in _MONEY_CODES), codes[0] or codes[1])
    return code, str(error.get("message") or "")

