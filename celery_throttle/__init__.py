"""celery_throttle: global, atomic rate limits for Celery tasks (Redis + one Lua GCRA script)."""

from __future__ import annotations

from .defer import HEADER
from .errors import (
    RateLimited,
    ThrottleConfigError,
    ThrottleError,
    ThrottleStoreError,
    ThrottleTimeout,
    check_response,
)
from .gate import Concurrency, Decision, Gate, Limit, Reservation
from .leases import settle
from .rates import Rate, parse_rate
from .task import Throttle, throttled
from .worker import install, limits_in_force, store_warnings

__all__ = [
    "HEADER",
    "Concurrency",
    "Decision",
    "Gate",
    "Limit",
    "Rate",
    "RateLimited",
    "Reservation",
    "Throttle",
    "ThrottleConfigError",
    "ThrottleError",
    "ThrottleStoreError",
    "ThrottleTimeout",
    "check_response",
    "install",
    "limits_in_force",
    "parse_rate",
    "settle",
    "store_warnings",
    "throttled",
]
