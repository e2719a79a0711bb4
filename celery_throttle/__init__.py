"""celery_throttle: global, atomic rate limits for Celery tasks (Redis + one Lua GCRA script)."""

from __future__ import annotations

from .errors import ThrottleConfigError, ThrottleError, ThrottleStoreError, ThrottleTimeout
from .gate import Decision, Gate, Limit
from .rates import Rate, parse_rate

__all__ = [
    "Decision",
    "Gate",
    "Limit",
    "Rate",
    "ThrottleConfigError",
    "ThrottleError",
    "ThrottleStoreError",
    "ThrottleTimeout",
    "parse_rate",
]
