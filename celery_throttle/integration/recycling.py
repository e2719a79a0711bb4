"""Replacing a recycled pool process at once.

Where prefork processes are recycled (``worker_max_tasks_per_child``,
``worker_max_memory_per_child``), Celery's pool replaces a process when it
sees it exit.  A process that is sent a task just before it exits can be
missed then: the pool replaces it only at its next maintenance, every 5 s,
and the task sent to it waits until then (Celery's issue #9588, which
Celery alone shows too).  A task dispatched for its booked start then loses it, and
the limit goes unused meanwhile.

So where processes are recycled, the worker's event loop runs the pool's own
maintenance (``maintain_pool``: reap exited processes, start their
replacements) every ``throttle_pool_check_interval`` too: a few ``waitpid``
calls, no store or broker call.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ..core.logs import logger
from . import hooks
from .runtime import runtime_for

__all__ = ["DEFAULT_INTERVAL", "keep_pool_full", "recycles"]

#: Seconds between the worker's checks for exited pool processes, where they are
#: recycled: a task sent to a process that exits waits at most about this long
#: for its replacement.
DEFAULT_INTERVAL = 0.25
_KEPT = "_celery_throttle_kept_full"  # pool attribute: its maintenance runs in the loop


def recycles(consumer: Any) -> bool:
    """Does the worker of this ``consumer`` recycle its pool processes
    (``worker_max_tasks_per_child`` or ``worker_max_memory_per_child``)?"""
    controller = getattr(consumer, "controller", None)
    return bool(getattr(controller, "max_tasks_per_child", None)
                or getattr(controller, "max_memory_per_child", None))


def keep_pool_full(app: Celery, consumer: Any) -> float:
    """Run the pool's maintenance every ``throttle_pool_check_interval`` in the worker's
    event loop, where its prefork processes are recycled; the interval (0: not run)."""
    configured = runtime_for(app).config.pool_check_interval
    interval = DEFAULT_INTERVAL if configured is None else configured
    if not (recycles(consumer) and interval > 0):
        return 0.0
    started = hooks.repeat_in_loop(consumer, interval, _KEPT)
    if started is None:
        return 0.0  # (no event loop, or no prefork pool)
    if started:  # (False: the consumer started again, and the loop runs it already)
        logger.info("celery_throttle: pool processes are recycled: replaced within %.3fs of their "
                    "exit", interval)
    return interval
