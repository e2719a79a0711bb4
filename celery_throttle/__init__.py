"""celery_throttle: global, atomic rate limits for Celery tasks (Redis + Lua GCRA scripts).

The gate and its records import with redis-py alone (``core/``), so a web app
that only waits with :class:`Gate` or :class:`AsyncGate` needs no Celery; the
Celery-side names (``throttled``, ``install``, ...) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .answers import check_response
from .core.async_gate import AsyncGate
from .core.gate import Gate
from .core.limits import Concurrency, Decision, Limit, Reservation
from .core.rates import Rate, parse_rate
from .errors import (
    LimitStopped,
    RateLimited,
    ThrottleConfigError,
    ThrottleError,
    ThrottleStoreError,
    ThrottleTimeout,
)

if TYPE_CHECKING:
    from .integration.declared import limits_in_force
    from .integration.install import install, store_warnings
    from .integration.leases import settle
    from .integration.throttled import Throttle, throttled
    from .room.header import HEADER

#: The package's version (the distribution ``celery-gcra-throttle``); see CHANGELOG.md.
__version__ = "0.2.0"

# Names that need Celery: resolved on first access (PEP 562), by their module.
_LAZY = {
    "HEADER": ".room.header",
    "Throttle": ".integration.throttled",
    "install": ".integration.install",
    "limits_in_force": ".integration.declared",
    "settle": ".integration.leases",
    "store_warnings": ".integration.install",
    "throttled": ".integration.throttled",
}


if not TYPE_CHECKING:  # type checkers read the imports above, and refuse unknown names

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # the next access is a plain lookup
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})


__all__ = [
    "HEADER",
    "AsyncGate",
    "Concurrency",
    "Decision",
    "Gate",
    "Limit",
    "LimitStopped",
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
