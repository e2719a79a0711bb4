"""The dispatcher: one thread per worker node moving due tasks from the waiting room to their queue.

Started by ``install(app)`` when the worker is ready (in the node's main
process, never in producers or pool children).  It serves the limits'
lines (``lines.py``: each task when its limits admit it) and claims the
due parked entries
in batches (``lua/dispatch.lua``: atomic, so two nodes never claim one
entry), publishes each message as captured, without an ETA, and sleeps
until the next dispatch time: a blocking pop on the wake list, which a park
pushes to when it parks a new earliest entry.  Idle, a node issues one
script call and one blocking pop per ``IDLE`` seconds.

Dispatched tasks go to a *lane* beside their queue (``<queue>.dispatched``),
which every worker consuming the queue also consumes (:func:`add_lanes`):
behind a backlog of fresh tasks in the queue itself, a dispatched task would
reach a worker long after its booked start.  A task re-published to wait comes back
by the lane too (:func:`by_lane`).

The thread is an operating-system thread also under the gevent and eventlet
pools (``native.py``), with a store client and a broker connection of its
own: in their event loop it would keep time only as well as the busiest
task greenlet lets it.

A revoked task leaves at once (:meth:`Dispatcher.cancel`, handed the ids of
each revoke command the node receives): one in line is dispatched without a
charge, wherever it waits, and its worker drops it and marks it REVOKED.

Where waiting tasks are also kept beside the broker's queues (``keeper.py``:
a store that would lose them), the dispatcher that first sees the store come
back without its data (a new epoch in a claim's reply) parks every kept task
in it again.

Nothing is lost if a dispatcher dies or the broker refuses a publish: a
claimed entry stays in the store until its message reaches a worker, and is
dispatched again after ``throttle_dispatch_timeout``, or at the dispatcher's
next try when the publish failed (the broker is down: the entry goes out as
soon as it is back).  The arrival takes only the first copy
(``lua/arrive.lua``).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery import Celery
from celery.worker.state import REVOKES_MAX
from kombu import Queue
from kombu.exceptions import ChannelError, OperationalError

from .. import faults
from ..core.logs import Every, logger
from ..values import to_us
from .entries import Served
from .envelope import Envelope
from .header import HEADER, START
from .keeper import Kept
from .keys import room_key
from .native import NativeThread
from .parking import RESTORING_ELSEWHERE, Parked, WaitingRoom

__all__ = ["LANE", "Dispatcher", "add_lanes", "by_lane", "lane_of", "queue_of"]

#: The longest sleep between two looks at the waiting room, in seconds.
IDLE = 5.0
#: The most entries claimed and published per script call.
BATCH = 200
# Waits up to this long are slept in the thread, longer ones in a blocking pop.
_FINE = 0.25
# After a store or broker error, wait this long before trying again.
_BACKOFF = 1.0
#: The most revoked task ids looked for per script call.
CANCEL_BATCH = 500
#: The suffix of a queue's lane for dispatched tasks.
LANE = ".dispatched"
#: Copies a lane may hold, not yet fetched by any worker, before lines are held.
LANE_SLACK = 4
# While a lane is backed up, look again this soon (seconds).
_HOLD = 0.05


def lane_of(queue: str) -> str:
    """The lane of ``queue`` (a lane is its own lane)."""
    return queue if queue.endswith(LANE) else queue + LANE


def queue_of(routing_key: str) -> str:
    """The queue a lane belongs to (any other name is returned as is)."""
    return routing_key[: -len(LANE)] if routing_key.endswith(LANE) else routing_key


def by_lane(envelope: Envelope) -> Envelope:
    """``envelope`` as a copy aimed at a start is sent: addressed to its queue by name, to
    the queue's lane, ahead of the backlog of fresh tasks in the queue itself; published
    to an exchange, where the exchange routes it."""
    return envelope if envelope.exchange else envelope.to(lane_of(envelope.routing_key))


def add_lanes(queues: Any) -> list[str]:
    """Consume the lane of every queue this worker consumes (Celery's ``amqp.queues``)
    that a task reaches by its name.

    Called after ``-Q`` is applied (``celeryd_after_setup``).  A lane is a
    plain queue on the same exchange, addressed by its name; Redis and AMQP
    brokers route a message published to the default exchange with a
    queue's name as routing key straight to it.  Only a queue on a direct
    exchange has one: Celery sends a task to such a queue by name (the
    default exchange), and so does the dispatcher its copies (:func:`by_lane`).
    A task routed by a topic, fanout or headers exchange is copied to that
    exchange, never to a lane; and a lane bound there would take a copy of
    whatever the exchange routes to its queue (every message of a fanout or
    ``Broadcast`` queue, every message a headers binding lets through).  The
    lane keeps its queue's priorities (``max_priority``) and arguments.
    """
    added = []
    for name, queue in list(queues.consume_from.items()):
        if name.endswith(LANE) or queue.name is None or not _by_name(queue):
            continue
        lane = lane_of(name)
        queues.select_add(Queue(lane, exchange=queue.exchange, routing_key=lane,
                                durable=queue.durable, queue_arguments=queue.queue_arguments,
                                max_priority=queue.max_priority))
        added.append(lane)
    return added


def _by_name(queue: Any) -> bool:
    """Does Celery send a task to ``queue`` by its name (a direct exchange, or none)?"""
    exchange = queue.exchange
    return exchange is None or not exchange.name or (exchange.type or "direct") == "direct"


class Dispatcher:
    """Dispatches ``app``'s due parked tasks to their queues, in a daemon thread."""

    def __init__(self, app: Celery, connect: Callable[..., Any], prefix: str, *,
                 timeout: float, lead: float = 0.0,
                 revoked: Callable[[str], bool] = lambda task_id: False,
                 keeper: Callable[[], Kept | None] = lambda: None) -> None:
        """``connect(**options)`` makes a client of the store (the app's ``Config.connect``);
        ``timeout``: seconds after which a dispatched task that never arrived is due again;
        ``lead``: a task of a limit's line is dispatched this much before its start, besides
        the measured trip (``throttle_dispatch_lead``; a parked task's dispatch time has it);
        ``revoked(task_id)``: is that task revoked (a task waiting in a limit's line is then
        dispatched without taking the limit, and its worker drops it); ``keeper()``: a
        keeper of the tasks kept beside the broker's queues, on a client of its own (None:
        none are kept), which the dispatcher restores when the store comes back empty."""
        self.app = app
        self.revoked = revoked
        self.timeout_us, self.lead_us = to_us(timeout), to_us(lead)
        self._connect = connect
        # A client of its own: its blocking pop must not hold the tasks'
        # connection, and its read timeout must outlast the pop.
        self.client = connect(socket_timeout=IDLE + 5, socket_connect_timeout=2,
                              health_check_interval=30)
        self.room = WaitingRoom(self.client, prefix, keeper=keeper())
        self._restored = 0  # the store's epoch the kept tasks are known restored for
        # The node's own list beside the shared wake list: stop() rings it, so a
        # warm shutdown does not wait out a blocking pop of up to IDLE seconds.
        self._bell = room_key(prefix, f"bell:{uuid.uuid4().hex}")
        self.dispatched = 0
        # Ids to look for (cancel(); a deque's ends are thread-safe).  Bounded as
        # Celery's own revoked set is: past it, a task still leaves at its turn.
        self._revoked: deque[str] = deque(maxlen=REVOKES_MAX)
        self._ringer: Any = None  # a client of the callers', made by the first ring
        self._thread = NativeThread(self._run, "celery-throttle-dispatcher")
        self._connection: Any = None  # to the broker, made by the first publish
        self._publisher: Any = None
        self._lanes: set[str] = set()  # the lanes this dispatcher published to
        self._probe: Any = None  # a channel that counts a lane's copies (_backed_up)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (it finishes the batch it is publishing; it closes its clients)."""
        self._thread.stop()
        self._ring()
        self._thread.join(timeout)
        if self._ringer is not None:
            self._ringer.close()

    def cancel(self, task_ids: Sequence[str]) -> None:
        """These tasks were revoked: those waiting leave the waiting room at once (the thread
        looks for them before its next dispatch, woken now)."""
        if task_ids:
            self._revoked.extend(task_ids)
            self._ring()

    def _ring(self) -> None:
        """Wake the thread from its blocking pop, on a client of the caller's: the thread's
        own may be blocked in that pop, and under a green pool belongs to its hub."""
        try:
            if self._ringer is None:
                self._ringer = self._connect(socket_timeout=2, socket_connect_timeout=2)
            with self._ringer.pipeline(transaction=False) as pipe:
                # Expires on its own if the thread was not asleep to pop it.
                pipe.rpush(self._bell, 1).pexpire(self._bell, int(IDLE * 2000)).execute()
        except redis.RedisError:
            pass  # the store is down: the pop fails on its own, or wakes within IDLE

    def dispatch_due(self) -> float | None:
        """Claim and publish one batch of parked tasks, and one of the limits' lines; return
        seconds until the next is due (0: more now; None: nothing waits)."""
        self._cancel_revoked()
        wait, parked = self.room.take_due(BATCH, self.timeout_us)
        if parked:
            faults.at("dispatch.before_publish", parked)
            self._publish(parked)
        self._restore_kept()
        if self._backed_up():
            return min(wait, _HOLD) if wait is not None else _HOLD
        turn, served = self.room.lines.serve_due(BATCH, self.timeout_us, self.revoked,
                                                  lead_us=self.lead_us)
        if served:
            faults.at("dispatch.before_publish", served)
            self._publish(served)
        waits = [w for w in (wait, turn) if w is not None]
        return min(waits) if waits else None

    def _backed_up(self) -> bool:
        """Do copies wait in a lane, not fetched by any worker (every consumer's prefetch is
        full)?  Lines are then held: a copy served now would be charged its start and
        reach a worker after it, lose it and be served again behind the same backlog, so
        a backlog, once there, would keep every start late.  Held, the lines keep their
        tasks uncharged until the workers have caught up."""
        if not self._lanes:
            return False
        try:
            if self._probe is None:
                self._producer()  # (its connection)
                self._probe = self._connection.channel()
            waiting = 0
            for lane in self._lanes:
                with contextlib.suppress(ChannelError):  # (an empty Redis lane is no list)
                    waiting += self._probe.queue_declare(queue=lane, passive=True).message_count
        except Exception:
            self._probe = None  # (an AMQP channel closes on an error: open another)
            return False
        return waiting > LANE_SLACK

    def _restore_kept(self) -> None:
        """The store's epoch changed (or was never checked here): if the tasks kept beside
        the broker's queues were not restored for it, they wait in the store again, where
        they waited (in their line, or parked due now)."""
        epoch = self.room.last_epoch
        if self.room.keeper is None:
            return
        if epoch != self._restored:
            handed = self.room.restore_kept(epoch)
            if handed == RESTORING_ELSEWHERE:
                return  # (asked again at the next round, until that node is done)
            self._restored = epoch
            if handed:
                logger.warning("throttle: the store came back without its data: %d waiting "
                               "task(s) kept on the broker wait again", handed)
        self.room.keeper.maintain()

    def _cancel_revoked(self) -> None:
        """Revoked tasks that wait leave: those in line are published uncharged now."""
        while self._revoked:
            ids = [self._revoked.popleft()
                   for _ in range(min(CANCEL_BATCH, len(self._revoked)))]
            try:
                served, parked = self.room.cancel(ids, self.timeout_us)
            except Exception:
                self._revoked.extendleft(reversed(ids))  # looked for again after the backoff
                raise
            if served:
                faults.at("dispatch.before_publish", served)
                self._publish(served)
            if served or parked:
                logger.info("throttle: %d revoked task(s) left the waiting room at once (%d in "
                            "line, %d parked)", len(served) + parked, len(served), parked)

    def _publish(self, parked: Sequence[Parked | Served]) -> None:
        """Publish a claimed batch.  A publish that fails (the broker is down) leaves that
        entry and the rest claimed, but due again at the next claim: not held for
        ``throttle_dispatch_timeout`` after the broker is back."""
        try:
            producer = self._producer()
        except Exception:
            self._due_again(parked)
            raise
        for i, item in enumerate(parked):
            try:
                self._publish_one(producer, item)
            except Exception:
                self._due_again(parked[i:])
                raise
            self.dispatched += 1

    def _due_again(self, unpublished: Sequence[Parked | Served]) -> None:
        # (A store down too: the claims' deadlines apply, as for a dispatcher that died.)
        with contextlib.suppress(redis.RedisError):
            self.room.overdue([item.entry for item in unpublished])

    def _publish_one(self, producer: Any, item: Parked | Served) -> None:
        policy = self.app.conf.task_publish_retry_policy
        queues = self.app.amqp.queues
        marks: dict[str, Any] = {"token": item.token, "room": item.epoch}
        if isinstance(item, Served):
            marks.update({"charged": item.flag, START: item.start or None})
        envelope = by_lane(Envelope.loads(item.message).with_header(HEADER, **marks))
        if not envelope.exchange:
            self._lanes.add(envelope.routing_key)
        # (Workers declare the lane when they consume it; the publish does too, and an
        # exchange's queues, so that this connection routes by the exchange's type.)
        envelope.publish(producer, queues=queues, retry_policy=policy)

    def _producer(self) -> Any:
        """A producer on the dispatcher's own broker connection (never the app's pool, whose
        connections a green pool's loop also uses), made by the first publish."""
        if self._connection is None:
            self._connection = self.app.connection_for_write()
            self._publisher = self.app.amqp.Producer(self._connection)
        return self._publisher

    def _run(self, thread: NativeThread) -> None:
        try:
            self._loop(thread)
        finally:
            self.client.close()
            if self.room.keeper is not None:
                self.room.keeper.close()
            if self._connection is not None:
                self._connection.release()

    def _loop(self, thread: NativeThread) -> None:
        outage = Every()
        while not thread.stopped:
            try:
                wait = self.dispatch_due()
                if wait == 0:
                    continue  # a full batch: more are due now
                if wait is not None and wait <= _FINE:
                    # Redis times a blocking pop out on its own clock tick
                    # (every 100 ms at the default hz 10): a near dispatch is
                    # slept here, where it is precise.
                    thread.wait(wait)
                else:
                    self.room.sleep(IDLE if wait is None else min(wait - _FINE / 2, IDLE),
                                    self._bell)
            except Exception as exc:  # a store or broker error: entries stay claimed
                if thread.stopped:
                    break
                if outage.due():
                    level = logging.WARNING if self._outage(exc) else logging.ERROR
                    logger.log(level, "throttle: dispatcher: %s: %s (claimed tasks not "
                               "published are dispatched again at its next try)",
                               type(exc).__name__, exc)
                thread.wait(_BACKOFF)

    def _outage(self, exc: Exception) -> bool:
        """``exc`` says the store or the broker is unreachable (a WARNING: it is tried again
        and ends with the outage), not that something is wrong (an ERROR)."""
        errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError,
                                                    OperationalError)
        if self._connection is not None:
            errors += tuple(self._connection.connection_errors)
        return isinstance(exc, errors)

    def __repr__(self) -> str:
        return f"Dispatcher(prefix={self.room.prefix!r}, dispatched={self.dispatched})"
