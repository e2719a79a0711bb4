"""Shadow mode: a limit decided and counted as usual, whose tasks never wait for it.

Which limits are in shadow mode is decided here, once, in this order: a
switch set at run time (``celery throttle shadow NAME on|off``, the
dashboard; ``core/live.py``) over the task's ``@throttled(enforce=...)``
over the app's ``throttle_enforce``.

A shadowed limit is decided in buckets of its own, under the prefix
``<prefix>.shadow``: a task that would have waited books the booked start it would
have had there, so the next one would have waited longer, exactly as the
enforced limit would have made it, and the shadow bucket's next free start is
when the would-have backlog drains.  The real buckets are never charged by a
shadowed limit: switched to enforcing, a limit starts from its real bucket
(full, if nothing enforced it meanwhile), not from a backlog no task waited
in.  The decision is made once the task is admitted by its enforced limits
(it runs now), so a task deferred by them is not counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from celery import Task

from .. import metrics
from ..core.limits import AnyLimit, seats_of
from ..core.logs import logger
from . import leases
from .runtime import Runtime

__all__ = ["decide", "enforced", "split"]


def enforced(runtime: Runtime, name: str, coded: bool | None) -> tuple[bool, str]:
    """Whether limit ``name`` is enforced, and who says so: "live", "code" or "app"."""
    live = runtime.live.enforcing().get(name)
    if live is not None:
        return live, "live"
    if coded is not None:
        return coded, "code"
    return runtime.config.enforce, "app"


def split(runtime: Runtime, limits: list[AnyLimit], coded: Mapping[str, bool]
          ) -> tuple[list[AnyLimit], list[AnyLimit]]:
    """``limits`` as (enforced, shadowed); ``coded``: limit name -> the decorator's
    ``enforce`` where it gave one."""
    on: list[AnyLimit] = []
    off: list[AnyLimit] = []
    for lim in limits:
        (on if enforced(runtime, lim.name, coded.get(lim.name))[0] else off).append(lim)
    return on, off


def decide(task: Task[Any, Any], runtime: Runtime, limits: list[AnyLimit]
           ) -> leases.Held | None:
    """Decide ``limits`` for ``task``, which runs now whatever they say; count what would
    have happened.  Returns the shadow leases to give back when the run ends (a
    concurrency limit that had a seat).  Never raises for the store: a shadow
    decision the store cannot make is counted as a store error and skipped."""
    concurrent = seats_of(limits)
    holder = str(task.request.id) if concurrent else ""
    gate = runtime.shadow
    try:
        decision = gate.acquire_many(limits, reserve=runtime.config.horizon, holder=holder)
    except redis.RedisError:
        metrics.store_error([lim.name for lim in limits])
        return None
    if decision.allowed:
        return leases.hold(gate, concurrent, holder) if concurrent else None
    limit = decision.limit if decision.limit is not None else limits[0]
    metrics.would_defer(limit.name, decision.retry_after)
    logger.info("throttle: task %s[%s] would wait %.3fs for limit %r (shadow mode: it runs "
                "now)", task.name, task.request.id, decision.retry_after, limit.name)
    return None

