"""The exception family.

::

    ThrottleError                 base of everything raised here
    ├── ThrottleTimeout           the task waited longer than its max_wait (task fails)
    ├── ThrottleStoreError        the throttle's Redis could not be used and
    │                             throttle_on_error="fail" (task fails)
    ├── ThrottleConfigError       a bad setting, also a ValueError (install / worker start)
    ├── LimitStopped              a gated client's call: the limit is stopped until
    │                             resumed (the provider said the money is spent)
    └── RateLimited               raised *by a task*: the provider said 429 (or that the
                                  money is spent); its limits pause (or stop) on every
                                  worker and the task waits

Bad decorator or gate arguments raise plain ``ValueError`` / ``TypeError``
naming the value, at definition time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import email.utils
import functools
from collections.abc import Sequence
from typing import Any, TypeVar

from .values import seconds

AnyLimitT = TypeVar("AnyLimitT")

__all__ = ["DEFAULT_RETRY_AFTER", "LimitStopped", "RateLimited", "ThrottleConfigError",
           "ThrottleError",
           "ThrottleStoreError", "ThrottleTimeout", "named_retry_after", "response_of",
           "retry_after_of",
           "status_of"]

#: Seconds a quota's refusal holds off when its headers name none (or none readable).
DEFAULT_RETRY_AFTER = 1.0
# A Retry-After beyond this is capped (a misbehaving or hostile header must
# not park every worker for days).
MAX_RETRY_AFTER = 3600.0


class ThrottleError(Exception):
    """Base class of celery_throttle's exceptions."""


class ThrottleTimeout(ThrottleError, TimeoutError):
    """A start would come later than a ``max_wait`` (a task's) or a ``timeout`` (a waiter's) allows.

    Constructible from its message alone: Celery's JSON result backend
    re-creates an exception as ``cls(*args)``.
    """

    def __init__(self, message: str, *, task_name: str = "", limit_name: str = "",
                 waited: float = 0.0, max_wait: float = 0.0) -> None:
        super().__init__(message)
        self.task_name = task_name
        self.limit_name = limit_name
        self.waited = waited
        self.max_wait = max_wait

    @classmethod
    def exceeded(cls, task_name: str, limit_name: str, waited: float,
                 max_wait: float) -> ThrottleTimeout:
        """The error for ``task_name`` that would wait ``waited`` s for ``limit_name``."""
        return cls(
            f"task {task_name!r} would wait {waited:.3f}s for limit {limit_name!r}, "
            f"past its max_wait of {max_wait:.3f}s",
            task_name=task_name, limit_name=limit_name, waited=waited, max_wait=max_wait)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickle keeps the details too (the default would keep only the message).
        return (functools.partial(type(self), task_name=self.task_name,
                                  limit_name=self.limit_name, waited=self.waited,
                                  max_wait=self.max_wait), self.args)


class ThrottleStoreError(ThrottleError):
    """The throttle's Redis failed and the policy is ``throttle_on_error="fail"``."""


class ThrottleConfigError(ThrottleError, ValueError):
    """A ``throttle_*`` setting has a wrong type or value, or is unknown."""


class LimitStopped(ThrottleError):
    """A call of a limit that is stopped until resumed: nothing was sent.

    The provider said the account's money is spent (``reason`` "money", its
    own words in ``provider_message``), and every worker and web process
    stopped sending under ``limit_name`` until ``celery throttle resume``.
    Constructible from its message alone (a JSON result backend re-creates an
    exception as ``cls(*args)``).
    """

    def __init__(self, message: str, *, limit_name: str = "", reason: str = "",
                 provider_message: str = "") -> None:
        super().__init__(message)
        self.limit_name = limit_name
        self.reason = reason
        self.provider_message = provider_message

    @classmethod
    def of(cls, limit_name: str, reason: str, provider_message: str) -> LimitStopped:
        """The error for a call of ``limit_name``, stopped for ``reason``."""
        said = f": {provider_message!r}" if provider_message else ""
        return cls(f"limit {limit_name!r} is stopped until resumed: the provider says the "
                   f"account's money is spent{said}; `celery throttle resume {limit_name}` "
                   "once it is not", limit_name=limit_name, reason=reason,
                   provider_message=provider_message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial(type(self), limit_name=self.limit_name, reason=self.reason,
                                  provider_message=self.provider_message), self.args)


class RateLimited(ThrottleError):
    """Raise it in a throttled task when the provider refuses a call (HTTP 429).

    The task's limits (or only those named in ``limits``) admit nothing for
    ``retry_after`` seconds, on every worker, and this task is re-scheduled
    to run after the pause, its retries untouched.  Its concurrency seat is
    given back at once.

    ``retry_after``: seconds, or the provider's refusal itself (a response,
    or an SDK's ``RateLimitError``), whose ``Retry-After-Ms``/``Retry-After``
    are read as :func:`~celery_throttle.check_response` reads them.
    ``stop``: the provider says the account's money is spent (its words):
    the limits are stopped until resumed instead (``Gate.stop``), and the task
    waits in line for that.  ``overloaded``: the provider is busy for everyone:
    the limits are held off for ``retry_after`` instead, their quota untouched
    (``Gate.follow`` with nothing left until then: no pause).  ``named``: the
    wait was named (given, or in the refusal's headers): a limit that learns
    its rate is paused only then, and cut in any case.
    """

    def __init__(self, retry_after: float | str | object | None = None, *,
                 limits: Sequence[str] = (), stop: str | None = None,
                 overloaded: bool = False) -> None:
        self.stop = stop
        self.overloaded = overloaded
        self.named = retry_after is not None and not isinstance(retry_after, str)
        message = None
        if retry_after is None:
            retry_after = DEFAULT_RETRY_AFTER
        elif isinstance(retry_after, str):  # re-created from its message by a result backend
            message, retry_after = retry_after, DEFAULT_RETRY_AFTER
        elif not isinstance(retry_after, int | float):
            named = named_retry_after(response_of(retry_after).headers or {})
            self.named = named is not None
            retry_after = DEFAULT_RETRY_AFTER if named is None else named
        self.retry_after = min(seconds("retry_after", retry_after), MAX_RETRY_AFTER)
        self.limits = tuple(limits)
        super().__init__(message or f"provider rate limit: retry after {self.retry_after:.3f}s")

    def limits_in(self, limits: Sequence[AnyLimitT]) -> list[AnyLimitT]:
        """The limits to pause among a task's ``limits`` (all, unless some were named)."""
        if not self.limits:
            return list(limits)
        chosen = [lim for lim in limits if getattr(lim, "name", None) in self.limits]
        if not chosen:
            known = sorted({str(getattr(lim, "name", "?")) for lim in limits})
            raise ValueError(f"RateLimited names limits {list(self.limits)!r}, but the task's "
                             f"limits are {known!r}")
        return chosen

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial(type(self), limits=self.limits, stop=self.stop,
                                  overloaded=self.overloaded),
                (self.retry_after if self.named else None,))


def status_of(response: Any) -> int | None:
    """``response``'s HTTP status (``status_code``, ``status`` or ``code``), None without."""
    return next((getattr(response, a) for a in ("status_code", "status", "code")
                 if isinstance(getattr(response, a, None), int)), None)


def response_of(obj: Any) -> Any:
    """``obj`` if it has an HTTP status, else the response an error carries; else TypeError
    naming ``obj``'s type."""
    if status_of(obj) is not None and getattr(obj, "headers", None) is not None:
        return obj
    inner = getattr(obj, "response", None)
    if inner is not None and status_of(inner) is not None:
        return inner
    raise TypeError(f"cannot read an HTTP status and headers from {type(obj).__name__!r}: "
                    "pass the response, or an error carrying it in .response")


def named_retry_after(headers: Any) -> float | None:
    """The seconds a refusal's headers name (as :func:`retry_after_of` reads them), None
    when they name none."""
    if not any(headers.get(h) is not None for h in
               ("retry-after-ms", "Retry-After-Ms", "retry-after", "Retry-After")):
        return None
    return retry_after_of(headers)


def retry_after_of(headers: Any) -> float:
    """Seconds to wait from a 429's headers (``Retry-After-Ms``, ``Retry-After``), default 1 s."""
    get = headers.get
    millis = get("retry-after-ms") or get("Retry-After-Ms")
    with contextlib.suppress(TypeError, ValueError):
        if millis is not None:
            return max(0.0, float(millis) / 1000)
    value = get("retry-after") or get("Retry-After")
    if value is None:
        return DEFAULT_RETRY_AFTER
    value = str(value).strip()
    with contextlib.suppress(ValueError):
        return max(0.0, float(value))
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        return max(0.0, (when - dt.datetime.now(dt.timezone.utc)).total_seconds())
    return DEFAULT_RETRY_AFTER
