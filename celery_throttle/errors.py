"""The exception family.

::

    ThrottleError                 base of everything raised here
    ├── ThrottleTimeout           the task waited longer than its max_wait (task fails)
    ├── ThrottleStoreError        the throttle's Redis could not be used and
    │                             throttle_on_error="fail" (task fails)
    └── ThrottleConfigError       a bad setting, also a ValueError (install / worker start)

Bad decorator or gate arguments raise plain ``ValueError`` / ``TypeError``
naming the value, at definition time.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["ThrottleConfigError", "ThrottleError", "ThrottleStoreError", "ThrottleTimeout"]


class ThrottleError(Exception):
    """Base class of celery_throttle's exceptions."""


class ThrottleTimeout(ThrottleError):
    """A task's start would come later than its ``max_wait`` allows.

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
