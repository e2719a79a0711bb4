"""celery_throttle: global, atomic rate limits for Celery tasks (Redis + one Lua GCRA script)."""

from __future__ import annotations

from .async_gate import AsyncGate
from .declared import limits_in_force
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
from .wait_state import HEADER
from .worker import install, store_warnings

#: The package's version (the distribution ``celery-gcra-throttle``); see CHANGELOG.md.
__version__ = "0.2.0"

__all__ = [
    "HEADER",
    "AsyncGate",
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
