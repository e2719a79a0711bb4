"""``@throttled`` and the gated run: the gate in a task's call path (``hooks.py`` plugs it in).

The gate sits in the task's call path (its ``run``), not in a signal handler:
Celery logs and swallows exceptions raised by signal receivers, so a receiver
cannot stop a task from running.  Direct calls (``task(...)``) and eager mode
(``task_always_eager``, ``task.apply()``) bypass the gate.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery import Task
from celery.local import PromiseProxy, Proxy

from ..core import credit
from ..core.keys import validate_name
from ..core.limits import DEFAULT_LEASE, AnyLimit, Concurrency, Limit, declared, rates_of
from ..core.logs import logger
from ..core.rates import Rate, parse_rate
from ..errors import LimitStopped, RateLimited, ThrottleTimeout
from ..room.dispatcher import queue_of
from ..values import check_cost, positive_int, seconds
from . import hooks, memory
from .act import Leave, carry_out
from .after_start import defer_after_start, release_leases_of
from .defer import admit, admitted_late
from .runtime import INSTALLED, Runtime, runtime_for

__all__ = ["Call", "Throttle", "call_of", "ensure_gated", "throttled"]


T = TypeVar("T")
ArgFn = Callable[..., Any]

_SPECS_ATTR = "__throttle_specs__"
# Shared tasks get one task object per app; the specs follow them by name.
_shared_specs: dict[str, list[Throttle]] = {}


@dataclass(frozen=True, slots=True)
class Throttle:
    """One ``@throttled`` (validated at definition time): a rate, a concurrency or both."""

    rate: Rate | None
    burst: int = 1
    key: str | ArgFn | None = None
    name: str | None = None
    cost: int | ArgFn = 1
    max_wait: float | None = None
    signature: inspect.Signature | None = field(default=None, compare=False, repr=False)
    concurrency: int | None = None
    lease: float = DEFAULT_LEASE
    fair: str | ArgFn | None = None
    enforce: bool | None = None  # None: the app's throttle_enforce
    adaptive: bool = False
    floor: Rate | None = None

    @property
    def estimated(self) -> bool:
        """The cost is an estimate made per call (a callable), which the task may settle."""
        return callable(self.cost)

    def limits(self, task_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> list[AnyLimit]:
        """The limits for one call: its rate limit and/or concurrency limit."""
        name = self.name or task_name
        key = self._arg_value(task_name, "key", self.key, args, kwargs)
        cost, fair = 1, None
        if self.rate is not None:  # (the cost and fair value of a rate limit alone)
            fair = self._arg_value(task_name, "fair", self.fair, args, kwargs)
            cost = self.cost(*args, **kwargs) if callable(self.cost) else self.cost
        try:
            return declared(name, self.rate, self.burst, key, cost, self.concurrency,
                            self.lease, fair, self.adaptive, self.floor)  # checks the cost
        except ValueError as exc:
            raise ValueError(f"task {task_name!r}: {exc}") from None
        except TypeError as exc:  # a key value of an unsupported type
            raise TypeError(f"task {task_name!r}, limit {name!r}: {exc}") from None

    def _arg_value(self, task_name: str, what: str, spec: str | ArgFn | None,
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
        """The value of ``key`` or ``fair`` for one call: a callable's result, or the
        argument it names."""
        value = None
        if callable(spec):
            value = spec(*args, **kwargs)
        elif spec is not None:
            assert self.signature is not None
            try:
                bound = self.signature.bind_partial(*args, **kwargs)
            except TypeError as exc:
                raise ValueError(f"task {task_name!r}: cannot bind arguments: {exc}") from exc
            if spec not in bound.arguments:
                raise ValueError(f"task {task_name!r}: {what} argument {spec!r} was not passed")
            value = bound.arguments[spec]
        if value is None and spec is not None:
            raise ValueError(f"task {task_name!r}: {what} argument {spec!r} is None")
        return value


def throttled(
    rate: str | Rate | None = None,
    *,
    burst: int = 1,
    key: str | ArgFn | None = None,
    name: str | None = None,
    cost: int | ArgFn = 1,
    max_wait: float | None = None,
    concurrency: int | None = None,
    lease: float = DEFAULT_LEASE,
    fair: str | ArgFn | None = None,
    enforce: bool | None = None,
    adaptive: bool = False,
    floor: str | Rate | None = None,
) -> Callable[[T], T]:
    """Limit every start of the decorated task, across all workers.

    Stack it *above* ``@app.task(...)`` or ``@shared_task(...)``; stacked
    ``@throttled`` limits are passed together, all or nothing.

    * ``rate``: starts per period ("10/s", "500/m"); may be left out when
      ``concurrency`` is given.
    * ``concurrency``: at most this many runs at once, across all workers.
      Each run holds a lease of ``lease`` seconds, renewed while it runs and
      given back when it ends in any state; a killed worker's lease expires.
    * ``key``: an argument name, or a callable taking the task's arguments,
      whose value selects one bucket per value (tenant, API key).
    * ``name``: the bucket's name; tasks with the same name share it
      (default: the task's name).
    * ``cost``: units per start, an int or a callable taking the task's
      arguments (an estimate the task may correct with
      :func:`celery_throttle.settle` once the true cost is known).
    * ``max_wait``: seconds the task may wait in total before it fails with
      :class:`~celery_throttle.ThrottleTimeout` (overrides ``throttle_max_wait``).
    * ``fair``: the same forms as ``key``: the
      tasks waiting in line for the rate limit are served by this value in
      turn (a tenant that floods the limit does not make the others wait
      behind all of its tasks), weighted by ``throttle_fair_weights``.
    * ``enforce``: False puts these limits in *shadow mode*: every decision is
      made and counted (would have waited, how long, for which limit) but the
      task runs at once (default: the app's ``throttle_enforce``; a live
      ``celery throttle shadow NAME on|off`` overrides both).
    * ``adaptive``: the provider's quota is not known: decide at a rate learned
      from its quota refusals, never above ``rate``, never below ``floor``
      (default: a tenth of ``rate``); see :class:`~celery_throttle.Limit`.

    Raising :class:`~celery_throttle.RateLimited` in the task (a provider's
    429) pauses its limits on every worker and re-schedules it, retries untouched.
    A :class:`~celery_throttle.LimitStopped` from a gated client under one of
    its limits (the provider said the money is spent) re-schedules it too: it
    waits in line until the limit is resumed.
    """

    def decorate(task: T) -> T:
        _hook_celery()
        label, fun, bind = _describe(task)
        try:
            spec = _build_spec(rate, burst, key, name, cost, max_wait, fun, bind,
                               concurrency, lease, fair, enforce, adaptive, floor)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"@throttled on task {label}: {exc}") from None
        if isinstance(task, Task):
            _attach(task, spec)
        elif isinstance(task, PromiseProxy) and not task.__evaluated__():
            task.__then__(lambda: _attach(task._get_current_object(), spec))
        else:  # a shared_task proxy: one task object per app
            real = task._get_current_object()  # type: ignore[attr-defined]
            _shared_specs.setdefault(real.name, []).append(spec)
            _attach(real, spec)
            for app in hooks.active_apps():
                if app.finalized and real.name in app._tasks:
                    other = app._tasks[real.name]
                    if other is not real:
                        _attach(other, spec)
        return task

    return decorate


def _describe(task: object) -> tuple[str, Callable[..., Any] | None, bool]:
    """A label for errors, the task's function and whether it is bound, without evaluating."""
    if isinstance(task, Task):
        return repr(task.name), task.run, False  # task.run is already bound when bind=True
    if isinstance(task, PromiseProxy) and not task.__evaluated__():
        try:
            # The proxy holds (fun,) and the task options until first use.
            fun = object.__getattribute__(task, "_Proxy__args")[0]
            opts = object.__getattribute__(task, "_Proxy__kwargs")
            return f"{fun.__module__}.{fun.__qualname__}", fun, bool(opts.get("bind"))
        except (AttributeError, IndexError):
            return "(lazy task)", None, False
    if isinstance(task, Proxy):
        real = task._get_current_object()
        return repr(real.name), real.run, False
    raise TypeError(
        f"@throttled must decorate a Celery task (put it above @app.task), got {task!r}")


def _build_spec(rate: object, burst: object, key: object, name: object, cost: object,
                max_wait: object, fun: Callable[..., Any] | None, bind: bool,
                concurrency: object = None, lease: object = DEFAULT_LEASE,
                fair: object = None, enforce: object = None, adaptive: object = False,
                floor: object = None) -> Throttle:
    if rate is None and concurrency is None:
        raise ValueError("give a rate, a concurrency, or both")
    if fair is not None and rate is None:
        raise ValueError("fair shares a rate: give a rate too")
    if (adaptive or floor is not None) and rate is None:
        raise ValueError("adaptive learns a rate: give a rate (the most it may reach)")
    parsed = parse_rate(rate) if rate is not None else None
    floored = parse_rate(floor) if floor is not None else None
    if parsed is not None:  # (the learning options, checked as the limit checks them)
        Limit("check", parsed, adaptive=adaptive, floor=floored)  # type: ignore[arg-type]
    if concurrency is not None:
        Concurrency("check", concurrency, None, lease)  # type: ignore[arg-type]
    positive_int("burst", burst)
    assert isinstance(burst, int)
    if name is not None:
        validate_name(name)
    if not callable(cost):
        check_cost(cost, burst, name if isinstance(name, str) else None)
    if max_wait is not None:
        seconds("max_wait", max_wait)
    if enforce is not None and not isinstance(enforce, bool):
        raise ValueError(f"enforce {enforce!r}: expected True or False")
    signature = None
    for what, spec in (("key", key), ("fair", fair)):
        if isinstance(spec, str):
            if fun is None:
                raise ValueError(f"{what} {spec!r}: the task's function cannot be inspected")
            if signature is None:
                signature = inspect.signature(fun)
                params = list(signature.parameters.values())
                if bind and params:
                    signature = signature.replace(parameters=params[1:])
            params = list(signature.parameters.values())
            if spec not in signature.parameters and not any(
                p.kind is p.VAR_KEYWORD for p in params
            ):
                raise ValueError(f"{what} {spec!r} is not an argument of the task "
                                 f"(arguments: {', '.join(signature.parameters) or 'none'})")
        elif spec is not None and not callable(spec):
            raise ValueError(f"invalid {what} {spec!r}: expected an argument name or a "
                             "callable")
    return Throttle(parsed, burst, key, name, cost, max_wait,  # type: ignore[arg-type]
                    signature, concurrency, lease, fair, enforce,  # type: ignore[arg-type]
                    bool(adaptive), floored)


def _attach(task: Task[Any, Any], spec: Throttle) -> None:
    specs: list[Throttle] = task.__dict__.setdefault(_SPECS_ATTR, [])
    specs.append(spec)
    ensure_gated(task)


def specs_of(task: Task[Any, Any]) -> list[Throttle]:
    """The ``@throttled`` limits of ``task`` (outermost last)."""
    return list(task.__dict__.get(_SPECS_ATTR, ()))


@dataclass(frozen=True, slots=True)
class Call:
    """What one call of a throttled task is held to."""

    limits: list[AnyLimit]  # at the rates in force
    max_wait: float | None
    estimated: set[str]  # the limits whose cost the task may settle
    coded: dict[str, bool]  # limit name -> the decorator's enforce (shadow.py)


def call_of(task: Task[Any, Any], runtime: Runtime, args: tuple[Any, ...],
            kwargs: dict[str, Any], queue: str | None) -> Call:
    """The limits of one call of ``task`` (its ``@throttled`` ones and its queue's), at the
    rates in force (set at run time: ``core/live.py``), as the pool process gating the
    run and the main process lining it up on arrival (``arrival.py``) both see them."""
    specs = task.__dict__.get(_SPECS_ATTR, ())
    limits = [lim for spec in specs for lim in spec.limits(task.name, args, kwargs)]
    queue_limit = runtime.config.queue_limit(queue)
    if queue_limit is not None:
        limits.append(queue_limit)
    return Call(runtime.live.apply(limits),
                next((s.max_wait for s in specs if s.max_wait is not None),
                     runtime.config.max_wait),
                {(s.name or task.name) for s in specs if s.estimated},
                {(s.name or task.name): s.enforce for s in specs if s.enforce is not None})


def ensure_gated(task: Task[Any, Any]) -> None:
    """Put the gate in ``task``'s call path (idempotent; ``hooks.wrap_run``: its ``run``
    and its ``Strategy``), before the worker builds its tracers, i.e. at import, app
    finalize or worker init.
    """
    if not hooks.wrap_run(task, functools.partial(_gated, task)):
        return
    # Failing past max_wait is the documented outcome, not a crash: Celery
    # logs an expected exception at INFO, without a traceback.
    if not issubclass(ThrottleTimeout, task.throws or ()):
        task.throws = (*(task.throws or ()), ThrottleTimeout)


def _gated(task: Task[Any, Any], run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` behind the gate: the task's ``run`` in its call path."""

    @functools.wraps(run)
    def gated_run(*args: Any, **kwargs: Any) -> Any:
        request = task.request
        if request.called_directly or request.is_eager:
            return run(*args, **kwargs)
        memory.collect_after_deferral()
        runtime = runtime_for(task.app)
        call = call_of(task, runtime, args, kwargs, _queue_of(request))
        if not call.limits:
            return run(*args, **kwargs)
        limits = call.limits
        started = False
        try:
            action, leave = admit(task, runtime, limits, call.max_wait, call.estimated,
                                  call.coded)
            carry_out(task, runtime, action, leave)  # (returns when it starts)
            started = True
        finally:
            if not started:  # (a seat held before admission gave up is renewed by nobody)
                release_leases_of(task)
        # The start this run was admitted for: a gated HTTP transport under the
        # same limit spends it on the run's first request (core/credit.py), if
        # that leaves soon enough after the start, not after this moment: a
        # task let go late in its booked start's grace has spent part of that already.
        now = time.monotonic() - admitted_late(task)
        unspent = credit.grant({runtime.gate.key_of(lim): credit.Admission(lim, now)
                                for lim in rates_of(limits)})
        try:
            try:
                return run(*args, **kwargs)
            except RateLimited as exc:
                limited = exc
            except LimitStopped as exc:  # (a gated client's: the task waits for the resume)
                if not any(lim.name == exc.limit_name for lim in limits):
                    raise  # (its limits are not the stopped one's: nothing to wait in)
                limited = RateLimited(limits=[exc.limit_name],
                                      stop=exc.provider_message or exc.reason)
            # The provider said "not now": hold every worker off these limits,
            # give back the leases (only once the pause is written), come back
            # after the pause.
            # (Its request left at the admission or later: read as the admission, a
            # refusal may be taken for one of before the last cut, never cut twice.)
            way_out = defer_after_start(task, runtime, limited.limits_in(limits),
                                        limited.retry_after, stop=limited.stop,
                                        overloaded=limited.overloaded, named=limited.named,
                                        refused_after=time.monotonic() - now)
        finally:
            credit.revoke(unspent)
            release_leases_of(task)  # the run ended, in whatever state
        # (Outside any handler: the run's end carries no earlier exception with it.)
        carry_out(task, runtime, way_out, Leave(limits))
        raise RuntimeError("unreachable: a way out ends the run")

    return gated_run


def _queue_of(request: Any) -> str | None:
    info = request.delivery_info or {}
    # Celery routes to a queue through the default (direct) exchange with the
    # queue's name as routing key; the Redis transport reports that key.  A
    # task dispatched from the waiting room comes through its queue's lane.
    key = info.get("routing_key")
    return queue_of(key) if key else None


def _gate_shared(sender: Any, **_: Any) -> None:
    for task_name, specs in _shared_specs.items():
        task = sender._tasks.get(task_name)
        if task is not None and _SPECS_ATTR not in task.__dict__:
            for spec in specs:
                _attach(task, spec)


def _warn_if_not_installed(sender: Any = None, **_: Any) -> None:
    """At worker start: @throttled tasks in an app that ``install(app)`` never saw.

    Connected by the first ``@throttled`` for every app (install() cannot
    connect it: it is what was forgotten).  Their own limits still apply in the task's call
    path; what install adds does not.
    """
    app = getattr(sender, "app", None)
    if app is None or getattr(app, INSTALLED, False):
        return
    names = sorted(name for name, task in list(app.tasks.items())
                   if task.__dict__.get(_SPECS_ATTR))
    if names:
        logger.warning(
            "celery_throttle: app %r has @throttled tasks (%s) but celery_throttle.install(app) "
            "was never called: their own limits apply, but queue limits (throttle_queues), "
            "the waiting room (they wait as countdowns), the startup checks and the metrics "
            "endpoint do not; call install(app) where the app is made",
            app.main, ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""))


def _hook_celery() -> None:
    """Connect the two receivers that cannot wait for ``install(app)``; idempotent.

    Called by ``@throttled`` as it decorates a task, never at import (a web
    app importing the gate connects nothing): the warning is about an app
    that ``install`` never saw, and shared tasks are gated in every app that
    finalizes, installed or not.
    """
    hooks.connect_decorator(_warn_if_not_installed, _on_app_finalize)


def _on_app_finalize(app: Any) -> None:
    # Runs as every app finalizes, before the shared tasks of that app
    # exist; so it only asks to be called once they do.
    hooks.connect_shared(app, _gate_shared)
