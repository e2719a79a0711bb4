"""Every place celery_throttle reaches into Celery, plugged in here and nowhere else.

The throttle works inside a worker through these hooks and no others
(:data:`HOOKS` lists them, each with the Celery attributes it relies on, which a
test checks in the oldest and the newest Celery the package supports):

* **run**: a gated task's ``run`` is wrapped (``throttled.ensure_gated``): the
  gate decides in the pool process, before the task's function, and a task
  that must wait ends its run with Celery's ``Ignore``.  Not a signal: Celery
  logs and swallows what a signal receiver raises, so a receiver cannot keep
  a task from running.  Wrapped before the worker builds its tracers, which
  capture ``task.run``.
* **strategy**: a gated task's ``Strategy`` (the message handler Celery's
  consumer builds per task type) is ``arrival.strategy``: a message may join
  its line in the main process, before a pool process takes it; the task's
  own strategy handles every other message.
* **signals**: the worker's life (``install.py``'s receivers, one app each):
  lanes consumed, the gate put in every task's path, each pool process's
  runtime, the node's checks and dispatcher, the end of a run, a revoked
  task forgotten; and ``@throttled``'s two (shared tasks gated in every app,
  a warning for an app never installed).
* **revoke**: Celery's ``revoke`` remote control command is wrapped: a task
  revoked while it waits in line leaves it at once (``revokes.py``).
* **prefetch**: a copy that arrives early for its start is held by the
  consumer's timer outside the prefetch window, as Celery holds a task with
  an ETA (``arrival.py``).
* **pool**: where pool processes are recycled, the pool's own maintenance runs
  in the worker's event loop too (``recycling.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task, signals
from celery import _state as celery_state
from celery.utils.imports import instantiate
from celery.worker.control import Panel

__all__ = ["HOOKS", "ORIGINAL_STRATEGY", "STRATEGY", "WORKER_SIGNALS", "Hook", "active_apps",
           "connect_decorator", "connect_shared", "connect_worker", "hold_outside_prefetch",
           "own_strategy", "repeat_in_loop", "wrap_revoke", "wrap_run"]


@dataclass(frozen=True, slots=True)
class Hook:
    """One way into Celery: what it is for and the attributes it relies on (dotted paths
    to a module's, a class's or a class attribute's name)."""

    name: str
    why: str
    relies_on: tuple[str, ...]


#: The receivers ``install(app)`` connects, by signal name (see ``install.py``).
WORKER_SIGNALS = ("celeryd_after_setup", "worker_init", "worker_process_init", "worker_ready",
                  "worker_process_shutdown", "worker_shutdown", "task_postrun", "task_revoked")

HOOKS: tuple[Hook, ...] = (
    Hook("run", "the gate decides in the pool process before the task's function",
         ("celery.app.task.Task.run", "celery.app.task.Task.request",
          "celery.exceptions.Ignore")),
    Hook("strategy", "a message joins its line in the main process, before the pool",
         ("celery.app.task.Task.Strategy", "celery.worker.strategy.default",
          "celery.utils.imports.instantiate", "celery.app.task.Context")),
    Hook("signals", "the worker's life: lanes, gating, runtimes, the dispatcher, run ends",
         (*(f"celery.signals.{name}" for name in WORKER_SIGNALS),
          "celery.app.base.Celery.on_after_finalize",
          "celery._state.connect_on_app_finalize", "celery._state._get_active_apps")),
    Hook("revoke", "a task revoked while it waits in line leaves it at once",
         ("celery.worker.control.Panel.data", "celery.utils.functional.maybe_list")),
    Hook("prefetch", "a copy early for its start is held outside the prefetch window",
         ("kombu.common.QoS.increment_eventually", "kombu.common.QoS.decrement_eventually",
          "kombu.asynchronous.timer.Timer.call_after")),
    Hook("pool", "a recycled pool process is replaced at once",
         ("billiard.pool.Pool.maintain_pool", "kombu.asynchronous.hub.Hub.call_repeatedly")),
)

_ORIGINAL_RUN = "__throttle_run__"
#: A gated task's Celery ``Strategy``; its own is kept under ORIGINAL_STRATEGY.
STRATEGY = "celery_throttle.integration.arrival:strategy"
ORIGINAL_STRATEGY = "__throttle_strategy__"
_MARK = "__celery_throttle__"  # on a wrapped remote control command


def wrap_run(task: Task[Any, Any], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
             ) -> bool:
    """Put ``wrap(task.run)`` in the task's call path and its message handler behind
    ``arrival.strategy``, once (False: the task was wrapped already)."""
    if _ORIGINAL_RUN in task.__dict__:
        return False
    run = task.run
    task.__dict__[_ORIGINAL_RUN] = run
    task.__dict__[ORIGINAL_STRATEGY] = task.Strategy
    task.Strategy = STRATEGY
    task.run = wrap(run)  # type: ignore[method-assign]
    return True


def own_strategy(task: Task[Any, Any], app: Celery, consumer: Any, **kwargs: Any) -> Any:
    """The message handler the task's own ``Strategy`` builds (Celery's, or its class's)."""
    return instantiate(task.__dict__.get(ORIGINAL_STRATEGY) or type(task).Strategy,
                       task, app, consumer, **kwargs)


def connect_worker(app: Celery, receivers: Mapping[str, Callable[..., Any]],
                   after_finalize: Callable[..., Any]) -> None:
    """Connect ``install(app)``'s receivers (by signal name, :data:`WORKER_SIGNALS`), and
    ``after_finalize`` to the app's finalize (called now where it is finalized)."""
    unknown = set(receivers) - set(WORKER_SIGNALS)
    if unknown:
        raise ValueError(f"not a hooked signal: {', '.join(sorted(unknown))}")
    if getattr(app, "finalized", False):
        after_finalize()
    else:
        app.on_after_finalize.connect(after_finalize, weak=False)
    for name, receiver in receivers.items():
        # weak=False: the receivers are closures, garbage-collected at once otherwise.
        getattr(signals, name).connect(receiver, weak=False)


def connect_decorator(worker_ready: Callable[..., Any],
                      app_finalized: Callable[[Any], None]) -> None:
    """Connect ``@throttled``'s two receivers, which cannot wait for ``install(app)``;
    idempotent: ``worker_ready`` (for every app) and ``app_finalized`` (as every app
    finalizes)."""
    signals.worker_ready.connect(worker_ready, weak=False,
                                 dispatch_uid="celery_throttle.warn_if_not_installed")
    celery_state.connect_on_app_finalize(app_finalized)  # a set: once


def active_apps() -> list[Any]:
    """The apps of this process (a shared task has one task object in each)."""
    return list(celery_state._get_active_apps())  # type: ignore[attr-defined]


def connect_shared(app: Any, gate_shared: Callable[..., Any]) -> None:
    """Call ``gate_shared`` once ``app``'s shared tasks exist (after its finalize)."""
    app.on_after_finalize.connect(gate_shared, sender=app, weak=False,
                                  dispatch_uid="celery_throttle.gate_shared")


def wrap_revoke(heard: Callable[[Any, Any], None]) -> None:
    """Wrap Celery's ``revoke`` command, once per process: Celery's own runs first and its
    reply is returned as it is, then ``heard(worker state, ids)``.

    Celery looks the command up in ``Panel.data`` by name for each message (the
    registry ``@Panel.register`` adds to), so the wrapper takes effect for the
    consumer whenever it is installed.
    """
    original = Panel.data.get("revoke")
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def revoke(state: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, *args, **kwargs)
        heard(state, args[0] if args else kwargs.get("task_id"))
        return reply

    setattr(revoke, _MARK, True)
    Panel.data["revoke"] = revoke


def hold_outside_prefetch(consumer: Any, seconds: float, release: Callable[[], None]) -> None:
    """Call ``release`` ``seconds`` from now in the consumer's timer, the message it hands
    on counted outside the prefetch window meanwhile (as Celery holds an ETA task)."""
    qos = consumer.qos
    qos.increment_eventually()

    def due() -> None:
        qos.decrement_eventually()
        release()

    consumer.timer.call_after(seconds, due, priority=6)


def repeat_in_loop(consumer: Any, interval: float, mark: str) -> bool | None:
    """Run the pool's maintenance (``maintain_pool``: reap exited processes, start their
    replacements) every ``interval`` seconds in the worker's event loop, once per pool
    (``mark``).  None: the worker has no event loop or no such pool; False: it runs
    already (the consumer started again)."""
    controller = getattr(consumer, "controller", None)
    hub = getattr(controller, "hub", None)
    pool = getattr(getattr(controller, "pool", None), "_pool", None)
    maintain = getattr(pool, "maintain_pool", None)
    if hub is None or not callable(maintain):
        return None
    if getattr(pool, mark, False):
        return False
    setattr(pool, mark, True)
    hub.call_repeatedly(interval, maintain)
    return True
