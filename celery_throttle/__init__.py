"""celery_throttle: global, atomic rate limits for Celery tasks (Redis + one Lua GCRA script)."""

from __future__ import annotations

from .defer import HEADER
from .errors import ThrottleConfigError, ThrottleError, ThrottleStoreError, ThrottleTimeout
from .gate import Concurrency, Decision, Gate, Limit, Reservation
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
    "Reservation",
    "Throttle",
    "ThrottleConfigError",
    "ThrottleError",
    "ThrottleStoreError",
    "ThrottleTimeout",
    "install",
    "limits_in_force",
    "parse_rate",
    "store_warnings",
    "throttled",
]
