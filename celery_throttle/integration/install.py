"""``install(app)``: queue limits for every task, and the worker's signal receivers.

Receivers (all idempotent, all for this app only; ``hooks.py`` connects them):

* ``celeryd_after_setup``: also consume each queue's lane, where tasks
  dispatched from a line or re-published to wait come back
  (``dispatcher.add_lanes``).
* ``on_after_finalize`` / ``worker_init``: put the gate in every task's call
  path (queue limits apply to undecorated tasks too).  This must happen before
  the worker builds its tracers, which capture ``task.run``.
* ``worker_process_init``: build the process's own runtime (a new store
  client in place of the one inherited across the prefork fork, keeping the
  node's verdict on the store: ``runtime.runtime_for``), off the first task's
  way, and freeze the inherited objects for the garbage collector
  (``throttle_gc_freeze``, ``memory.py``).  The scripts are not loaded again:
  the node's main process loaded them at ``worker_ready`` (the server keeps
  them for every client), and a script the server lost since is loaded by
  the first call that finds it missing (NOSCRIPT).
* ``worker_ready``: load the script, log one line listing the limits in force,
  warn if the store may evict bucket keys (:func:`store_warnings`), say
  whether waiting tasks may wait in the store (``room/durability.py``:
  a warning naming the reason when they may not), and start the node's dispatcher
  (``throttle_waiting_room``: one per node, in its main process), which also
  hears the node's revoke commands (``revokes.py``).
* ``worker_process_shutdown`` / ``worker_shutdown``: close the connection
  (and stop the dispatcher).
* ``task_revoked``: a task revoked or expired while it waited is forgotten
  by the waiting room, and announced dropped (``notes.forget_revoked``).
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery
from celery.worker import state as worker_state
from redis.cluster import RedisCluster

from .. import metrics
from ..core.limits import Limit
from ..core.logs import logger
from ..room.dispatcher import Dispatcher, add_lanes
from ..room.durability import Verdict
from . import hooks, revokes
from .after_start import run_ended
from .config import read_config
from .declared import known_limits, limits_in_force
from .exporter import serve
from .memory import freeze_inherited
from .notes import forget_revoked
from .recycling import keep_pool_full
from .runtime import INSTALLED, forget, keeper_of, runtime_for
from .throttled import ensure_gated

__all__ = ["install", "store_warnings"]




def install(app: Celery) -> Celery:
    """Enable celery_throttle on ``app``: call once where the app is made (idempotent).

    Validates the ``throttle_*`` settings now (raising
    :class:`~celery_throttle.ThrottleConfigError` naming the bad setting) and
    again when a worker starts.
    """
    if getattr(app, INSTALLED, False):
        return app
    setattr(app, INSTALLED, True)
    read_config(app)
    dispatchers: list[Dispatcher] = []

    def gate_all(**_: Any) -> None:
        for name, task in list(app.tasks.items()):
            if not name.startswith("celery."):  # Celery's own chord/chain helpers stay free
                ensure_gated(task)

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if _is_ours(sender):
            # Pool processes cannot see the node's -E flag; the setting carries
            # it to them (the value the worker derived from both), so that a
            # deferral sends its task-throttled event only where events are on.
            events = getattr(sender, "task_events", None)
            if events is not None:
                app.conf.worker_send_task_events = bool(events)
            read_config(app)
            gate_all()
            metrics.prepare()  # before the pool forks: never on a task's path

    def on_postrun(sender: Any = None, task: Any = None, state: Any = None, **_: Any) -> None:
        # No state: the run was cut off, not ended (the process exits: a node's SIGTERM
        # reaching its pool processes raises SystemExit in the task, and Celery still
        # sends this signal).  acks_late's broker redelivers its message, which must go on.
        if task is not None and getattr(task, "app", None) is app and state is not None:
            run_ended(task)

    def on_process_init(**_: Any) -> None:
        # The process's own runtime (runtime_for replaces the one inherited through
        # fork, whose client shares its socket with the parent), built now rather than
        # at the first task: its connections stay off that task's way to its start.
        if runtime_for(app).config.gc_freeze:
            freeze_inherited()

    def on_ready(sender: Any = None, **_: Any) -> None:
        if _is_ours(sender):
            _preload()
            logger.info("celery_throttle: limits in force: %s", "; ".join(limits_in_force(app))
                        or "none")
            port = runtime_for(app).config.metrics_port
            if port is not None:
                serve(app, port)
                logger.info("celery_throttle: metrics on port %d", port)
            config = runtime_for(app).config
            try:
                for warning in store_warnings(runtime_for(app).gate.client):
                    logger.warning("celery_throttle: %s", warning)
            except redis.RedisError as exc:
                logger.warning("celery_throttle: store not reachable at start: %s",
                               type(exc).__name__)
            if config.waiting_room:
                _report_durability(runtime_for(app).durability.verdict())
                try:
                    # The tasks already waiting in line follow the rates of this code.
                    runtime_for(app).room.lines.declare(
                        [k.limit for k in known_limits(app) if isinstance(k.limit, Limit)])
                except redis.RedisError as exc:
                    logger.warning("celery_throttle: could not record the limits' rates: %s",
                                   type(exc).__name__)
            keep_pool_full(app, sender)
            if config.waiting_room and not dispatchers:
                dispatcher = Dispatcher(app, config.connect, config.prefix,
                                        timeout=config.dispatch_timeout,
                                        lead=config.dispatch_lead, revoked=_revoked,
                                        keeper=lambda: keeper_of(config, app))
                dispatcher.start()
                dispatchers.append(dispatcher)
                revokes.listen(app, dispatcher.cancel)
                logger.info("celery_throttle: waiting room on: this node dispatches waiting "
                            "tasks up to %.3fs before their start", config.dispatch_lead)

    def on_shutdown(**_: Any) -> None:
        forget(app)

    def on_revoked(sender: Any = None, request: Any = None, expired: bool = False,
                   **_: Any) -> None:
        if getattr(sender, "app", None) is app and request is not None:
            forget_revoked(app, request, expired=expired)

    def on_worker_shutdown(sender: Any = None, **_: Any) -> None:
        while dispatchers:
            dispatcher = dispatchers.pop()
            revokes.unlisten(app, dispatcher.cancel)
            dispatcher.stop()
        forget(app)

    def _preload() -> None:
        try:
            runtime_for(app).gate.preload()
        except Exception as exc:
            logger.warning("celery_throttle: could not preload the gate script: %s",
                           type(exc).__name__)

    def _is_ours(sender: Any) -> bool:
        return sender is None or getattr(sender, "app", app) is app

    def on_after_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
        if instance is not None and getattr(instance, "app", None) is app:
            lanes = add_lanes(app.amqp.queues)
            logger.info("celery_throttle: consuming the lanes of tasks aimed at a start: %s",
                        ", ".join(lanes) or "none")

    hooks.connect_worker(app, {
        "worker_init": on_worker_init, "celeryd_after_setup": on_after_setup,
        "worker_process_init": on_process_init, "worker_ready": on_ready,
        "worker_process_shutdown": on_shutdown, "worker_shutdown": on_worker_shutdown,
        "task_postrun": on_postrun, "task_revoked": on_revoked}, after_finalize=gate_all)
    return app


def store_warnings(client: redis.Redis | RedisCluster) -> list[str]:
    """What about the store's configuration could break the limits (empty if nothing).

    An evicted bucket forgets its recent starts and lets one extra burst
    through; every bucket key has a TTL, so ``volatile-*`` policies evict
    them as readily as ``allkeys-*``.  Managed Redis services often refuse
    CONFIG GET: then nothing can be said, and nothing is.  (Whether waiting
    tasks may live in the store is the waiting room's own check,
    ``room/durability.py``.)
    """
    try:
        config = client.config_get("maxmemory*")
    except redis.ResponseError:
        return []
    found = []
    policy = str(config.get("maxmemory-policy", "noeviction"))
    if int(config.get("maxmemory", 0) or 0) > 0 and policy != "noeviction":
        found.append(f"the store may evict bucket keys (maxmemory-policy {policy}): an evicted "
                     "bucket lets one extra burst through; use noeviction or a Redis of its own")
    return found


def _report_durability(verdict: Verdict) -> None:
    """Say once, at the node's start, whether waiting tasks wait in the store, and why."""
    if verdict.safe:
        logger.info("celery_throttle: waiting tasks wait in the store: %s", verdict.reason)
    else:
        logger.warning("celery_throttle: waiting tasks do not wait in the store: %s; tasks "
                       "that wait longer than throttle_max_sleep are re-published with a "
                       "countdown (they stay in the broker).  Turn on appendonly yes there, "
                       "or set throttle_waiting_room = \"always\" to park anyway",
                       verdict.reason)


def _revoked(task_id: str) -> bool:
    """Revoked, as this worker node knows it (``app.control.revoke`` reaches every node's
    main process, where the dispatcher runs)."""
    return task_id in worker_state.revoked
