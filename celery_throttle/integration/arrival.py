"""A throttled task's messages in the worker's main process, before a pool process sees them.

Two things happen here, where waiting costs no pool process:

* **Lining up.**  A fresh message of a throttled task whose first limit is a
  rate limit joins that limit's line as it is if it would wait there: behind
  the tasks in line, or, the line empty, when the limit admits no start
  within the booking horizon, where a pool process would put it in line
  (one store call, ``enqueue.lua``, which writes nothing otherwise; its
  seats, where it has a concurrency limit too, are given at its turn, as
  for a task a pool process put in line).  Its message is acknowledged,
  and no pool process sees it until its turn.  After a look that found the
  line empty and a start near, the next messages go to the pool without a
  look for up to :data:`EMPTY_FOR_S`, each counted as the start it will
  take, until those starts reach past the horizon.  So a backlog
  moves from the broker's queue, in the broker's order, into the line, where
  the line orders it (turns, priorities), as fast as the consumer takes
  messages in, not as fast as pool processes come free; and a pool whose
  processes are recycled (``worker_max_tasks_per_child``) is not brought
  closer to a replacement by a run that only lines a task up.
* **Holding an early copy.**  A copy dispatched from a line for a start it
  was charged for arrives ahead of that start (the dispatch's lead and trip
  estimate cover the way there).  It is held here, outside Celery's prefetch
  window as Celery holds an ETA task, until a start's length before its
  start, then handed to the pool, whose process sleeps the rest: a process is
  taken for the handoff, not for the lead, so a fast limit's copies do not
  fill the pool (and with it the prefetch window, which would stall the
  lining up of the backlog behind them).  How long it was held travels with
  it (``WaitState.held``): its arrival leaves that out of the trip estimate.

Everything else goes on to the pool as before, where the gate decides: an
empty line, a message with an ETA, a task whose first limit is a concurrency
limit (its line is a seat's: nothing to be behind), a limit in shadow mode,
and any error (a store that fails is left alone for
:data:`PAUSE_AFTER_ERROR_S`: the consumer must not wait on it message after
message).

It hooks in as the task's Celery ``Strategy`` (``hooks.py``), the function
Celery's consumer builds per task type to handle its messages: the task's
own strategy is kept and called for every message not lined up here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, Task
from celery.app.task import Context
from celery.worker import state as worker_state

from ..core.keys import key_digest
from ..core.limits import Limit
from ..core.logs import logger
from ..room.dispatcher import queue_of
from ..room.header import HEADER, START
from ..room.lines import MAX_AHEAD_US
from ..values import from_us, to_us
from . import hooks, shadow
from .line import in_line_horizon, join_line_on_arrival
from .runtime import Runtime, runtime_for
from .throttled import call_of
from .waiter import Waiter

__all__ = ["EMPTY_FOR_S", "HANDOFF_S", "lines_up", "strategy"]

#: After a store error, messages go straight to the pool for this long.
PAUSE_AFTER_ERROR_S = 5.0
#: How often the store's clock is read again (it is carried on this process's meanwhile).
CLOCK_REFRESH_S = 10.0
#: After a look found a limit's line empty and its next start near, fresh messages of it
#: go straight to the pool for up to this long (seconds), while the starts they will
#: take stay within the booking horizon: where nothing waits, the look would cost every
#: message a store call and its message packed.  A line that forms meanwhile is found
#: by the pool's gate (its decision answers "queued"), which lines the task up there.
EMPTY_FOR_S = 0.05
#: The most lines remembered as empty (a per-key limit has one per key value).
EMPTY_LINES = 1024
#: A dispatched copy is handed to the pool one start's length (its limits' longest
#: interval) before its start, at least HANDOFF_S and at most HANDOFF_MAX_S (seconds):
#: the consumer's timer (tens of ms late on a busy node), the pool's handoff (a process
#: free, or replaced where processes are recycled) and the process's arrival call fit
#: in it, while a fast limit's copies keep about one process per start's length asleep.
HANDOFF_S, HANDOFF_MAX_S = 0.02, 0.1


def lines_up(app: Celery) -> bool:
    """Does this worker line tasks up on arrival (with the waiting room: tasks wait in
    lines)?"""
    return runtime_for(app).config.waiting_room


def strategy(task: Task[Any, Any], app: Celery, consumer: Any, **kwargs: Any) -> Any:
    """The task's message handler (Celery's ``Task.Strategy``): its own, behind a look at
    whether the message joins a line on arrival."""
    own = hooks.own_strategy(task, app, consumer, **kwargs)
    if not lines_up(app):
        return own
    arrivals = _Arrivals(task, consumer)

    def task_message_handler(message: Any, body: Any, ack: Callable[..., Any],
                             reject: Callable[..., Any], callbacks: Any, **options: Any) -> Any:
        if arrivals.lined_up(message):
            ack(logger, consumer.connection_errors)
            return None
        early = arrivals.early_by(message)
        if early > 0:
            arrivals.hold(message, early,
                          lambda: own(message, body, ack, reject, callbacks, **options))
            return None
        return own(message, body, ack, reject, callbacks, **options)

    return task_message_handler


class _Arrivals:
    """One task type's arrivals at one worker's consumer."""

    def __init__(self, task: Task[Any, Any], consumer: Any) -> None:
        self.task = task
        self.consumer = consumer
        self.paused_until = 0.0
        self.clock: tuple[float, int] | None = None  # (monotonic, the store's us) when read
        # line -> (monotonic end of EMPTY_FOR_S, the limit's next start after the messages
        # handed on since its look, us, store clock)
        self.empty: dict[tuple[str, str], tuple[float, int]] = {}

    def lined_up(self, message: Any) -> bool:
        """True when ``message`` now waits in line (to be acknowledged), else False."""
        if time.monotonic() < self.paused_until:
            return False
        headers = message.headers
        if not isinstance(headers, dict) or HEADER in headers or headers.get("eta"):
            return False  # (dispatched from the line, re-published, or held by an ETA)
        task_id = headers.get("id")
        if not isinstance(task_id, str) or task_id in worker_state.revoked:
            return False  # (Celery drops a revoked one)
        try:
            runtime = runtime_for(self.task.app)
            payload = message.payload  # (decoded once: kombu keeps it for Celery's request)
            if not (isinstance(payload, (list, tuple)) and len(payload) == 3):
                return False  # (Celery's message protocol 1)
            args, kwargs, embed = payload
            return self._line_up(runtime, message, headers, tuple(args), dict(kwargs),
                                 embed or {})
        except redis.RedisError as exc:
            self.paused_until = time.monotonic() + PAUSE_AFTER_ERROR_S
            logger.warning("celery_throttle: tasks are not lined up on arrival for %.0fs: "
                           "the store failed (%s); the pool gates them",
                           PAUSE_AFTER_ERROR_S, type(exc).__name__)
        except Exception as exc:  # the pool gates it, and reports what is wrong there
            logger.debug("celery_throttle: task %s[%s] not lined up on arrival: %s: %s",
                         self.task.name, task_id, type(exc).__name__, exc)
        return False

    def early_by(self, message: Any) -> float:
        """How long before its pool should see it a copy charged for its start arrived
        (seconds; 0: hand it on now, as any other message)."""
        headers = message.headers
        state = headers.get(HEADER) if isinstance(headers, dict) else None
        if not (isinstance(state, dict) and state.get("charged") == "c"
                and isinstance(state.get(START), int)):
            return 0.0
        try:
            ahead = from_us(state[START] - self._now_us(runtime_for(self.task.app)))
        except redis.RedisError:
            return 0.0  # (the pool's process sleeps it, as it would)
        spacing = state.get("spacing")
        length = from_us(max(spacing)) if isinstance(spacing, list) and spacing \
            and all(isinstance(t, int) for t in spacing) else 0.0
        handoff = min(max(length, HANDOFF_S), HANDOFF_MAX_S)
        return max(0.0, min(ahead, from_us(MAX_AHEAD_US)) - handoff)

    def hold(self, message: Any, seconds: float, handoff: Callable[[], Any]) -> None:
        """Hand ``message`` on (``handoff``) ``seconds`` from now, outside the prefetch window
        meanwhile (as Celery holds a message with an ETA); what it was held is noted in its
        header, for its arrival's trip estimate."""
        held_from = time.monotonic()

        def release() -> None:
            state = message.headers.get(HEADER)
            if isinstance(state, dict):
                state["held"] = to_us(time.monotonic() - held_from)
            handoff()

        hooks.hold_outside_prefetch(self.consumer, seconds, release)

    def _line_up(self, runtime: Runtime, message: Any, headers: dict[str, Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any], embed: dict[str, Any]) -> bool:
        info = message.delivery_info or {}
        routing_key = info.get("routing_key")
        call = call_of(self.task, runtime, args, kwargs,
                       queue_of(str(routing_key)) if routing_key else None)
        limits, shadowed = shadow.split(runtime, call.limits, call.coded)
        if shadowed or not limits or not isinstance(limits[0], Limit):
            return False
        properties = message.properties or {}
        # The message's fields as Celery's own request holds them: what a result backend
        # records beside the task's THROTTLED state (never pushed as the task's request).
        context = Context({
            **headers, **embed, "args": args, "kwargs": kwargs,
            "delivery_info": {"exchange": info.get("exchange"), "routing_key": routing_key,
                              "priority": properties.get("priority"),
                              "redelivered": info.get("redelivered", False)},
            "hostname": self.consumer.hostname, "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"), "properties": properties,
        })
        first = limits[0]
        line = (first.name, "" if first.key is None else key_digest(first.key))
        now = time.monotonic()
        now_us = self._now_us(runtime)
        step = first.cost * first.rate.interval_us  # (the start a message handed on takes)
        clear = self.empty.get(line)
        if clear is not None and clear[0] > now \
                and clear[1] - now_us <= to_us(in_line_horizon(runtime)):
            self.empty[line] = (clear[0], max(clear[1], now_us) + step)
            return False
        waiter = Waiter.of_message(self.task, headers, properties, context,
                                   self._events(context))
        behind = join_line_on_arrival(waiter, runtime, limits, call.max_wait, message, now_us)
        if behind.ahead != -1:
            self.empty.pop(line, None)
            self._received(headers, context)
            return True
        if len(self.empty) >= EMPTY_LINES:
            self.empty = {k: v for k, v in self.empty.items() if v[0] > now}
        if len(self.empty) < EMPTY_LINES:
            self.empty[line] = (now + EMPTY_FOR_S, now_us + behind.wait_us + step)
        return False

    def _now_us(self, runtime: Runtime) -> int:
        """The store's clock now (us): read every CLOCK_REFRESH_S, carried on this process's
        monotonic clock meanwhile (a task's place in line is that precise: the round trip)."""
        now = time.monotonic()
        if self.clock is None or now - self.clock[0] > CLOCK_REFRESH_S:
            sec, usec = runtime.gate.client.time()
            after = time.monotonic()
            self.clock = ((now + after) / 2, int(sec) * 1_000_000 + int(usec))
            now = after
        return self.clock[1] + to_us(now - self.clock[0])

    def _events(self, context: Context) -> Callable[..., Any] | None:
        """How a task event about the message is sent from here: by the consumer's own
        dispatcher, as Celery's strategy sends ``task-received``, where the worker sends
        task events (``worker_send_task_events``, as a pool process reads it; None: it
        sends none)."""
        eventer = self.consumer.event_dispatcher
        if not (eventer is not None and self.task.app.conf.worker_send_task_events):
            return None

        def send(kind: str, **fields: Any) -> None:
            eventer.send(kind, uuid=context.id, **fields)

        return send

    def _received(self, headers: dict[str, Any], context: Context) -> None:
        """Celery's ``task-received`` event, as its strategy sends it (Flower learns the
        task's name and arguments from it), where the worker sends task events."""
        eventer = self.consumer.event_dispatcher
        if not (eventer and eventer.enabled and self.task.send_events):
            return
        with contextlib.suppress(Exception):  # (the task waits in line already)
            eventer.send("task-received", uuid=context.id, name=self.task.name,
                         args=headers.get("argsrepr"), kwargs=headers.get("kwargsrepr"),
                         root_id=context.root_id, parent_id=context.parent_id,
                         retries=headers.get("retries", 0), eta=None,
                         expires=headers.get("expires"))
