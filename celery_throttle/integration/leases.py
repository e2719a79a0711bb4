"""What a running task holds: concurrency leases (renewed by a heartbeat) and settle().

A task admitted under a concurrency limit holds a lease in Redis under its
task id (``decide.lua`` takes it atomically with the task's other limits).
While the run lasts, the process's heartbeat (``core/heartbeat.py``) renews
every lease the process holds, every third of the shortest lease; when the
run ends in any state, the gated run gives the lease back.  A process that dies
(SIGKILL, OOM, a hard time limit) renews nothing, and its leases expire one
lease time later, reclaimed by the next decision on that limit.

:func:`settle` corrects an estimated cost once the task knows the true one
(the provider's ``usage``).
"""

from __future__ import annotations

import redis
from celery import current_task

from ..core.heartbeat import Held, hold, release
from ..core.limits import rates_of
from ..core.logs import logger
from ..values import units
from .run import Admitted, run_of

__all__ = ["Admitted", "Held", "hold", "release", "settle"]


def settle(actual: int, limit: str | None = None) -> bool:
    """Correct the current task's estimated cost to ``actual`` units (e.g. tokens used).

    Call it from a throttled task once the true cost is known.  ``limit``
    names the limit; it may be left out when exactly one of the task's
    limits has a computed (estimated) cost.  The bucket is charged or
    refunded the difference; a second call corrects the first.  Returns
    False without effect outside a worker run admitted by the gate (direct
    calls, eager mode), or if the store cannot be reached (logged).
    """
    units("actual cost", actual)
    task = current_task
    run = run_of(getattr(task, "request", None))
    admitted = run.admitted if run is not None else None
    if admitted is None:
        return False
    rates = rates_of(admitted.limits)
    if limit is None:
        chosen = [lim for lim in rates if lim.name in admitted.estimated]
        if len(chosen) != 1:
            raise ValueError("settle() needs limit=...: the task's limits with an estimated "
                             f"cost are {sorted(lim.name for lim in chosen)!r}")
    else:
        chosen = [lim for lim in rates if lim.name == limit]
        if not chosen:
            raise ValueError(f"settle(): the task has no rate limit {limit!r} (its limits: "
                             f"{sorted({lim.name for lim in admitted.limits})!r})")
    try:
        for lim in chosen:
            admitted.gate.settle(lim, actual, charged=admitted.charged.get(lim.name))
            admitted.charged[lim.name] = actual
    except redis.RedisError as exc:
        logger.warning("throttle: could not settle limit %r (%s: %s)", chosen[0].name,
                       type(exc).__name__, exc)
        return False
    return True
