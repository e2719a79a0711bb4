"""Fault injection: the named moments where a crash tests what the throttle promises.

The library calls :func:`at` at each point; nothing is registered in
production, so each call is one dictionary lookup.  A test's worker process
registers a hook with :func:`inject` (the test app does it from its
environment), rather than patching private functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["POINTS", "at", "clear", "inject"]

#: Every injection point: what has just happened when it is reached.
POINTS = {
    "dispatch.before_publish": "the dispatcher claimed a batch of due parked tasks "
                              "(argument: the batch) and has not published it",
    "defer.published": "the broker took a re-published copy of a deferred task (argument: "
                       "the task); a connection error raised here is a confirm lost with "
                       "the connection: the publish is tried again",
    "defer.after_republish": "a deferred task was re-published with a countdown "
                             "(argument: the task) and the running copy is not yet acknowledged",
    "defer.start_slept": "a task slept until the start it was admitted for (a booked start "
                         "just ahead) or charged for (dispatched from its limit's line) "
                         "(argument: the task) and has not checked it is in time",
}

# This module's state: the hooks registered in this process.
_hooks: dict[str, Callable[..., None]] = {}


def inject(point: str, hook: Callable[..., None]) -> None:
    """Call ``hook`` with the point's argument each time ``point`` is reached."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}: expected one of {sorted(POINTS)}")
    _hooks[point] = hook


def clear() -> None:
    """Remove every hook."""
    _hooks.clear()


def at(point: str, *args: Any) -> None:
    """``point`` is reached: run its hook, if a test registered one."""
    hook = _hooks.get(point)
    if hook is not None:
        hook(*args)
