"""Waiting in RabbitMQ itself: a re-published task's delay kept by the broker, not a worker.

A task re-published to wait (a countdown: the waiting room is off, or its
store would lose what waits there) travelled with an ETA: the broker hands
such a message to a worker at once, and the worker holds it unacknowledged
until then, so a deep backlog lived in the workers' memory (and in their
prefetch), and all of a dead node's came back at once.  On RabbitMQ the
message waits in the broker instead, on a ladder of queues whose messages
expire (a per-queue TTL) into the next rung down (dead-lettering); no plugin:

* rung ``k`` (k = 0 .. :data:`RUNGS` - 1) is a headers exchange and a quorum
  queue, both named ``celery_throttle.delay.<k>``; the queue's messages live
  ``2**k`` milliseconds, then are dead-lettered to rung ``k - 1``'s exchange
  (rung 0's to the delivery exchange);
* a message carries a header per rung from the highest bit of its delay (in
  milliseconds) down, ``celery_throttle_d<k>``: ``"1"`` routes it through
  rung k's queue (it waits ``2**k`` ms there), ``"0"`` straight on to the
  next exchange down.  Published to the rung of its delay's highest bit, it
  waits the delay to the millisecond, one pass per set bit (a pass costs
  about a millisecond more);
* the delivery exchange (``celery_throttle.delay.out``, headers) hands it by
  ``celery_throttle_to`` to the exchange it was published to, which routes it
  by its routing key as at its first publish (whatever that exchange's type
  and bindings); a message published to the default exchange goes to the
  queue its routing key names.  Each such exchange or queue is bound there
  once.  The routing key is never touched, so Celery and the throttle see it
  as it was published.

Every rung expires in order (one TTL per queue), the messages are
persistent and the queues quorum queues that dead-letter at least once (a
rung keeps a message until the next one down has confirmed it): a broker's
kill and restart keeps every message, the ones on their way from rung to
rung too, and a message whose time passed while the broker was down goes on
when it is back.  At least once: a message whose move the kill interrupted
may arrive twice (the copy pointer, ``copies.py``, drops the second: it is not
flagged as the broker's redelivery).  The topology is
declared once per connection to the broker, the first time it is used there,
and each destination bound once per connection: a broker that restarted has
lost a transient (non-durable) queue's bindings, and one whose data was
wiped the whole ladder, and a connection made since is a new one.  A copy
that comes back to a queue addressed by name goes to the queue's lane
(``dispatcher.by_lane``), ahead of its backlog.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kombu.common import maybe_declare

__all__ = [
    "DELIVERY",
    "MAX_DELAY_MS",
    "RUNGS",
    "TO_HEADER",
    "Ladder",
    "origin",
    "rung_headers",
    "rung_name",
    "strip",
    "target",
]

#: Rungs of the ladder: the longest delay one trip can wait is 2**RUNGS - 1 ms (49 days).
RUNGS = 32
#: The longest delay (milliseconds) one trip down the ladder waits.
MAX_DELAY_MS: int = 2**RUNGS - 1
# Every exchange and queue of the ladder is named with this prefix.
_PREFIX = "celery_throttle.delay."
#: The exchange the bottom rung delivers to (routing by :data:`TO_HEADER`).
DELIVERY = _PREFIX + "out"
#: The header naming where a message goes back to (:func:`target`).
TO_HEADER = "celery_throttle_to"
_BIT_PREFIX = "celery_throttle_d"
_BIT = _BIT_PREFIX + "{}"


def rung_name(rung: int) -> str:
    """The exchange and queue of ``rung``."""
    return f"{_PREFIX}{rung}"


def rung_headers(delay_ms: int) -> tuple[str, dict[str, str]]:
    """The exchange to publish a delay of ``delay_ms`` to, and the headers that route it
    down the ladder (a delay of 0 goes straight to :data:`DELIVERY`)."""
    if not 0 <= delay_ms <= MAX_DELAY_MS:
        raise ValueError(f"a delay of {delay_ms!r} ms is not within 0..{MAX_DELAY_MS}")
    if delay_ms == 0:
        return DELIVERY, {}
    top = delay_ms.bit_length() - 1
    return rung_name(top), {_BIT.format(k): str(delay_ms >> k & 1) for k in range(top + 1)}


def origin(exchange: str, headers: dict[str, Any]) -> str:
    """The exchange a message that came down the ladder was first published to: its
    delivery names the ladder's exchange (dead-lettering), its header where it went back
    to.  Any other message's ``exchange`` as it is."""
    to = headers.get(TO_HEADER)
    if not (exchange.startswith(_PREFIX) and isinstance(to, str)):
        return exchange
    kind, _, name = to.partition(":")
    return name if kind == "x" else ""


def strip(headers: dict[str, Any]) -> dict[str, Any]:
    """``headers`` without the ladder's own (a copy's message carries its last trip's)."""
    # RabbitMQ's own record of its dead-letterings goes too: a message whose x-death
    # names a rung's queue it expires from again is taken for a loop and dropped.
    return {k: v for k, v in headers.items()
            if k != TO_HEADER and not k.startswith((_BIT_PREFIX, "x-death",
                                                    "x-first-death-", "x-last-death-"))}


def target(exchange: str, routing_key: str) -> str:
    """Where the delivery sends a message published to ``exchange`` with ``routing_key``
    back to: ``x:<exchange>``, or, for the default exchange (which cannot be bound to),
    ``q:<queue>``, the queue the routing key names."""
    return f"x:{exchange}" if exchange else f"q:{routing_key}"


class Ladder:
    """The ladder on one broker: declared, and the queues bound to it, once per connection."""

    def __init__(self) -> None:
        # connection (py-amqp's) -> the destinations bound on it; a connection is a key
        # once the ladder is declared on it
        self._bound: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def send(self, producer: Any, envelope: Any, delay: float, queues: Any) -> None:
        """Publish ``envelope`` (an ``envelope.Envelope`` as :func:`capture` made it: no ETA,
        the last trip's headers stripped; not imported here, as envelope.py imports this
        module) through ``producer`` to arrive ``delay`` seconds from now (at most
        :data:`MAX_DELAY_MS`)."""
        if not envelope.exchange and envelope.routing_key in queues:
            # (declared as apply_async would, before it is bound)
            maybe_declare(queues[envelope.routing_key], producer.channel)
        to = target(envelope.exchange, envelope.routing_key)
        self.ready(producer.channel, to)
        exchange, bits = rung_headers(min(max(round(delay * 1000), 0), MAX_DELAY_MS))
        envelope.via(exchange, {**envelope.headers, **bits, TO_HEADER: to}).publish(
            producer, retry=False)

    def ready(self, channel: Any, to: str) -> None:
        """Declare the ladder and bind ``to`` (:func:`target`) to its delivery, on
        ``channel``, once per connection (a broker that lost them since, restarted or wiped,
        is reached by a new connection)."""
        with self._lock:
            bound = self._bound.get(channel.connection)
            if bound is None:
                _declare(channel)
                bound = self._bound[channel.connection] = set()
            if to not in bound:
                kind, name = to.split(":", 1)
                match = {"x-match": "all", TO_HEADER: to}
                if kind == "x":
                    channel.exchange_bind(name, DELIVERY, routing_key="", arguments=match,
                                          nowait=True)
                else:
                    channel.queue_bind(name, DELIVERY, routing_key="", arguments=match,
                                       nowait=True)
                bound.add(to)


# A classic queue dead-letters a message unconfirmed: a node killed meanwhile loses
# messages that were on their way down (or already in their queue, not yet on disk).
# A quorum queue keeps each until the queue it is dead-lettered to has confirmed it
# (at-least-once dead-lettering: RabbitMQ 3.10; it needs reject-publish overflow).
_SAFE = {"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once",
         "x-overflow": "reject-publish"}


def _declare(channel: Any) -> None:
    # nowait: the 129 declarations go out in one stream, not a round trip each (a
    # process's first wait would take about half a second, past a near booked start).  The
    # broker handles a channel's frames in order: the publish that follows is
    # confirmed after them, or fails with the channel if one of them was refused.
    channel.exchange_declare(DELIVERY, "headers", durable=True, auto_delete=False, nowait=True)
    for rung in range(RUNGS):
        name = rung_name(rung)
        below = rung_name(rung - 1) if rung else DELIVERY
        channel.exchange_declare(name, "headers", durable=True, auto_delete=False, nowait=True)
        channel.queue_declare(name, durable=True, auto_delete=False, nowait=True, arguments={
            "x-message-ttl": 2**rung, "x-dead-letter-exchange": below, **_SAFE})
        # "1": wait on this rung; "0": on to the next one down at once.
        channel.queue_bind(name, name, routing_key="", nowait=True,
                           arguments={"x-match": "all", _BIT.format(rung): "1"})
        channel.exchange_bind(below, name, routing_key="", nowait=True,
                              arguments={"x-match": "all", _BIT.format(rung): "0"})
