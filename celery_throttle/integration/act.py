"""Carrying out what the admission decided: the one place a gated task's run ends early.

``defer.admit`` decides an action (``admission.py``) and :func:`carry_out` does
it: it returns when the task starts, and on every other action the copy leaves
the worker (``exits.py``, ``line.py``) and its run ends here, with Celery's
``Ignore`` (it waits elsewhere, or was dropped: the message is acknowledged,
no result is stored), :class:`~celery_throttle.ThrottleTimeout` or
:class:`~celery_throttle.ThrottleStoreError`.  No other function of the
package both returns and ends a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery import Task
from celery.exceptions import Ignore

from ..core.limits import AnyLimit, Decision
from ..errors import ThrottleStoreError, ThrottleTimeout
from ..room.header import WaitState
from . import memory
from .admission import (
    Action,
    Away,
    CountDown,
    Drop,
    JoinLine,
    Known,
    Sleep,
    Start,
    StoreFailed,
    TimeOut,
    WaitForStore,
)
from .exits import dropped, wait_counted_down, wait_for_store
from .line import join_line
from .runtime import Runtime

__all__ = ["Leave", "carry_out"]


@dataclass(frozen=True, slots=True)
class Leave:
    """What a way out needs besides its action: the task's ``limits`` and the ``state`` of the
    copy that leaves; for a wait out of the process, the gate's last answer
    (``decision``) and what was known then (``known``)."""

    limits: list[AnyLimit] = field(default_factory=list)
    state: WaitState = field(default_factory=WaitState)
    decision: Decision | None = None
    known: Known | None = None


def carry_out(task: Task[Any, Any], runtime: Runtime, action: Action, leave: Leave) -> None:
    """Do what the admission decided: return when the task starts (:class:`Start`); on any
    other action its copy leaves the worker and its run ends here.

    The one function that both returns and ends a run.  A way out that cannot be
    taken hands back the one to take instead (a line the store failed to take: a
    countdown; a copy the waiting room has already: a drop).  A copy that waits
    elsewhere, or was dropped, ends with Celery's ``Ignore`` (acknowledged, no result
    stored), raised from here, not from deep in the admission: Celery copies every
    frame of its traceback (see ``memory.py``).
    """
    for _ in range(8):  # (a chain is shorter: a line, then a countdown, a drop, away)
        if isinstance(action, Start):
            return
        if isinstance(action, TimeOut):
            raise ThrottleTimeout.exceeded(task.name, action.limit, action.waited,
                                           action.max_wait)
        if isinstance(action, StoreFailed):
            raise ThrottleStoreError(f"throttle store unavailable for task {task.name!r}: "
                                     f"{action.error}") from action.cause
        if isinstance(action, Away):
            memory.deferred()
            raise Ignore()
        action = _take(task, runtime, action, leave)
    raise RuntimeError(f"unreachable: no way out after {action!r}")


def _take(task: Task[Any, Any], runtime: Runtime, action: Action, leave: Leave) -> Action:
    """Take the way out ``action`` names; what follows (:class:`Away` once it has left)."""
    if isinstance(action, Drop):
        dropped(task, action)
        return Away()
    if isinstance(action, WaitForStore):
        wait_for_store(task, runtime, leave.state, action)
        return Away()
    if isinstance(action, JoinLine):
        assert leave.decision is not None
        assert leave.known is not None
        return join_line(task, runtime, leave.limits, leave.decision, action, leave.state,
                         leave.known) or Away()
    if isinstance(action, CountDown):
        assert leave.decision is not None
        return wait_counted_down(task, runtime, leave.limits, leave.state, leave.decision,
                                 action) or Away()
    assert not isinstance(action, Sleep), "a sleep is the plan's, never a way out"
    raise TypeError(f"not a way out: {action!r}")
