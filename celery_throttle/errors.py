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

__all__ = ["ThrottleConfigError", "ThrottleError", "ThrottleStoreError", "ThrottleTimeout"]


class ThrottleError(Exception):
    """Base class of celery_throttle's exceptions."""


class ThrottleTimeout(ThrottleError):
    """A task's start would come later than its ``max_wait`` allows."""

    def __init__(self, task_name: str, limit_name: str, waited: float, max_wait: float) -> None:
        self.task_name = task_name
        self.limit_name = limit_name
        self.waited = waited
        self.max_wait = max_wait
        super().__init__(
            f"task {task_name!r} would wait {waited:.3f}s for limit {limit_name!r}, "
            f"past its max_wait of {max_wait:.3f}s"
        )

    def __reduce__(self) -> tuple[type[ThrottleTimeout], tuple[str, str, float, float]]:
        # Results backends pickle or re-create exceptions from their args.
        return (type(self), (self.task_name, self.limit_name, self.waited, self.max_wait))


class ThrottleStoreError(ThrottleError):
    """The throttle's Redis failed and the policy is ``throttle_on_error="fail"``."""


class ThrottleConfigError(ThrottleError, ValueError):
    """A ``throttle_*`` setting has a wrong type or value, or is unknown."""
