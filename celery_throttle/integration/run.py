"""One run of a gated task: what it was admitted under and what it holds, in one object.

Celery pushes a fresh request context (``task.request``) for every execution,
thread- and greenlet-local, and keeps it until ``task_postrun`` has been sent:
the run's state rides on it under one attribute, so the admission, the gated
run's end, ``settle()`` and the ``task_postrun`` receiver all find the same
:class:`Run`.  Nothing else of the run is written on the request, except the
two rewrites of :func:`rewrite`, which copies made later must see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.gate import Gate
from ..core.heartbeat import Held
from ..core.limits import AnyLimit
from ..room.header import HEADER

if TYPE_CHECKING:
    from ..room.header import WaitState
    from .runtime import Runtime

__all__ = ["Admitted", "Held", "Run", "rewrite", "run_of", "start_run"]

_RUN = "_celery_throttle_run"  # the request attribute holding the run's Run


@dataclass
class Admitted:
    """What a run was admitted under, for ``settle()`` (``leases.py``)."""

    gate: Gate
    limits: list[AnyLimit]
    estimated: set[str]  # names of limits whose cost was an estimate
    charged: dict[str, int] = field(default_factory=dict)  # settled costs so far


@dataclass(eq=False)
class Run:
    """The state of one run, from its admission to its end."""

    runtime: Runtime
    #: How long after the start it was admitted for it was let go (seconds).
    late: float = 0.0
    #: A pointed copy (``exits.pointed_copy``): the copy whose pointer this run moved to
    #: "ran:" (``run_ended`` moves it to "done:"); None before, and once the run ended or
    #: went back to wait.
    started: WaitState | None = None
    #: The concurrency leases the run holds, and its shadow leases (``shadow.py``).
    leased: Held | None = None
    shadow_leased: Held | None = None
    #: What it was admitted under, for ``settle()``; None if the gate did not admit it.
    admitted: Admitted | None = None


def start_run(request: Any, runtime: Runtime) -> Run:
    """A new run on ``request`` (its admission begins), replacing any earlier one."""
    run = Run(runtime)
    setattr(request, _RUN, run)
    return run


def run_of(request: Any) -> Run | None:
    """The run on ``request``; None where none was admitted (a direct call, an
    ungated task, a request context of its own)."""
    run = getattr(request, _RUN, None)
    return run if isinstance(run, Run) else None


def rewrite(request: Any, *, routing_key: str | None = None,
            header: dict[str, Any] | None = None) -> None:
    """Write what a copy of the task made later from ``request`` must carry (Celery's
    ``retry()`` and every re-publish build the copy from ``delivery_info`` and
    ``headers``): its queue's own routing key where it came by that queue's lane, and our
    header once the start it was booked for is spent."""
    if routing_key is not None:
        request.delivery_info = {**(request.delivery_info or {}), "routing_key": routing_key}
    if header is not None:
        request.headers = {**(request.headers or {}), HEADER: header}
