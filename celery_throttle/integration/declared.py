"""Which limits an app declares: its queue limits and every task's ``@throttled`` limits.

The one home of that question, asked by the worker's start line
(:func:`limits_in_force`), ``celery throttle status`` and the Prometheus
exporter (:func:`known_limits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery

from ..core.limits import Concurrency, Limit, declared
from ..core.rates import Rate
from .config import read_config
from .throttled import specs_of

__all__ = ["KnownLimit", "known_limits", "limits_in_force"]


@dataclass(frozen=True, slots=True)
class KnownLimit:
    """A limit the app declares: queue limits, then each task's ``@throttled`` limits."""

    limit: Limit | Concurrency  # with no key value; cost 1 when computed per call
    keyed: bool
    used_by: tuple[str, ...]  # "queue q" or task names
    # The code's (rate, burst) when ``limit`` shows a rate set at run time.
    code: tuple[Rate, int] | None = None
    enforce: bool | None = None  # the decorator's enforce= (None: the app's setting)


def known_limits(app: Celery) -> list[KnownLimit]:
    """Every limit ``app`` declares, one entry per bucket name (tasks sharing a name merge)."""
    config = read_config(app)
    found: dict[str, KnownLimit] = {}
    for q in config.queues:
        found[q.limit.name] = KnownLimit(q.limit, False, (f"queue {q.queue}",))
    leases: dict[str, KnownLimit] = {}
    for task_name, task in sorted(app.tasks.items()):
        for spec in specs_of(task):
            name = spec.name or task_name
            cost = spec.cost if isinstance(spec.cost, int) else 1
            for lim in declared(name, spec.rate, spec.burst, None, cost, spec.concurrency,
                                spec.lease, None, spec.adaptive, spec.floor):
                table = leases if lim.leased else found
                old = table.get(name)
                table[name] = (KnownLimit(old.limit, old.keyed, (*old.used_by, task_name),
                                          enforce=old.enforce if old.enforce is not None
                                          else spec.enforce)
                               if old else KnownLimit(lim, spec.key is not None, (task_name,),
                                                      enforce=spec.enforce))
    return [*found.values(), *leases.values()]


def limits_in_force(app: Celery) -> list[str]:
    """One human-readable line per limit of ``app`` (queue limits, then task limits)."""
    config = read_config(app)
    lines = [f"queue {q.queue}: {q.limit.rate} burst {q.limit.burst}" for q in config.queues]
    for name, task in sorted(app.tasks.items()):
        for spec in specs_of(task):
            key = f" per {spec.key if isinstance(spec.key, str) else 'key'}" if spec.key else ""
            what = [f"{spec.rate} burst {spec.burst}"] if spec.rate is not None else []
            if spec.concurrency is not None:
                what.append(f"{spec.concurrency} at once (lease {spec.lease:g}s)")
            lines.append(f"task {name}: {spec.name or name} {', '.join(what)}{key}")
    return lines
