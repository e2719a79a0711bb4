"""A task's message, serialized as Celery would publish it, to be published later as is.

:func:`capture` runs Celery's own publishing path (``apply_async``: routing,
options, protocol-2 headers, the task's serializer and compression) with a
stand-in producer that records the publishes instead of sending them, and
keeps the task's own message (Celery may publish more through the same
producer: the ``task-sent`` event of ``task_send_sent_event``).  The
dispatcher later publishes the recorded body, headers and routing unchanged
with a real producer: the task's arguments are never deserialized outside
the worker that runs it, whatever the serializer (json, pickle, msgpack).

Stored, an envelope is compressed (:meth:`Envelope.dumps`): a waiting task's
message is mostly Celery's own protocol-2 headers, the same names and
defaults in every message, so deflate is primed with them (a preset
dictionary): a small task's message is stored in about a fifth of its
JSON (BENCHMARKS.md, "Memory of a task waiting in line").

A task waiting in a limit's line is stored as one record: what the
dispatch needs of it (``entries.entry_json``), a newline, then its envelope
(:func:`in_line`), so the waiting room keeps one hash field per waiting
task.  The record's JSON never holds a raw newline (``json.dumps`` escapes
it), so the first one ends it.
"""

from __future__ import annotations

import contextlib
import json
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kombu import pools
from kombu.compression import compress
from kombu.serialization import dumps

from .ladder import Ladder, origin, strip

__all__ = ["Envelope", "capture", "confirmed_producer", "in_line", "ladder_of", "split_record"]

# The first byte of a stored envelope: its format.  A format, once stored,
# is read for as long as a task may wait in it (a dictionary is never
# changed in place: a new one gets a new tag).
_DEFLATED = b"\x01"  # the fields' JSON, NUL, the raw body; deflated with _DICTIONARY
_RECORD = b"\x02"  # a task in line: its dispatch record (JSON), a newline, its envelope
# What most messages share, latest-used last (deflate finds nearer matches
# cheaper): Celery's protocol-2 headers and properties, this package's header,
# the body's embed part.  Never edited (see above).
_DICTIONARY = (
    b'[[], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
    b'{"ct":"application/x-msgpack","ce":"binary","x":"","rk":"celery","h":{"lang":"py",'
    b'"task":"","id":"","shadow":null,"eta":null,"expires":null,"group":null,'
    b'"group_index":null,"retries":0,"timelimit":[null,null],"root_id":"","parent_id":null,'
    b'"argsrepr":"()","kwargsrepr":"{}","origin":"gen@","ignore_result":false,'
    b'"replaced_task_nesting":0,"stamped_headers":null,"stamps":{},'
    b'"celery_throttle":{"slot":null,"booked":0,"epoch":0,"shift":0,"deferrals":1,'
    b'"since":17,"copy":"","prev":"","spacing":[],"entry":"","token":"","room":0}},'
    b'"p":{"correlation_id":"","reply_to":"","delivery_mode":2,"priority":0}}'
    b'{"ct":"application/json","ce":"utf-8","x":"","rk":"celery","h":{"lang":"py","task":"'
)
_WBITS = -15  # raw deflate: no zlib header or checksum (Redis keeps the bytes intact)

# Properties not replayed: "expiration" is relative to the capture (the
# worker checks the `expires` header itself when the message arrives).
_DROPPED = frozenset({"expiration"})
# The properties Celery publishes a task with (Envelope.of_message keeps these).
_PUBLISHED = frozenset({"correlation_id", "reply_to", "delivery_mode", "priority"})


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message: its serialized body, content type, routing, headers and properties."""

    body: bytes = field(repr=False)
    content_type: str
    content_encoding: str
    exchange: str
    routing_key: str
    headers: dict[str, Any] = field(repr=False)
    properties: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_message(cls, message: Any, headers: dict[str, Any]) -> Envelope:
        """A received kombu ``message`` as it was published, with ``headers`` merged in.

        kombu hands over the body decompressed: the ``compression`` header goes
        too, as kombu's own re-delivery of a message drops it.  Only the
        publisher's properties are kept (a transport adds its own: a delivery
        tag, the body's encoding, ...).
        """
        info = message.delivery_info or {}
        body = message.body
        if isinstance(body, str):
            body = body.encode(message.content_encoding or "utf-8")
        merged = {**(message.headers or {}), **headers}
        merged.pop("compression", None)
        properties = {k: v for k, v in (message.properties or {}).items()
                      if k in _PUBLISHED and v is not None}
        return cls(body, message.content_type, message.content_encoding,
                   str(info.get("exchange") or ""), str(info.get("routing_key") or ""),
                   merged, properties)

    def dumps(self) -> bytes:
        """The envelope, compressed, to store (:meth:`loads` reads it)."""
        fields = json.dumps({
            "ct": self.content_type, "ce": self.content_encoding, "x": self.exchange,
            "rk": self.routing_key, "h": self.headers, "p": self.properties,
        }, default=str, separators=(",", ":")).encode()
        # JSON never holds a raw NUL (json.dumps escapes it): the first one ends the fields.
        packer = zlib.compressobj(6, zlib.DEFLATED, _WBITS, zdict=_DICTIONARY)
        return _DEFLATED + packer.compress(fields + b"\0" + self.body) + packer.flush()

    @classmethod
    def loads(cls, raw: bytes | str) -> Envelope:
        """Read an envelope written by :meth:`dumps`; ``ValueError`` if it is not one."""
        d, body = _fields(raw)
        try:
            return cls(body, d["ct"], d["ce"], d["x"], d["rk"], d["h"], d["p"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a stored envelope (no field {exc})") from None

    @staticmethod
    def task_id_in(raw: bytes | str | None) -> str:
        """The task id in a stored envelope's headers ("" if there is none or it is unreadable)."""
        try:
            headers = _fields(raw or b"")[0].get("h")
        except ValueError:
            return ""
        task_id = headers.get("id") if isinstance(headers, dict) else None
        return task_id if isinstance(task_id, str) else ""

    def with_header(self, name: str, **values: Any) -> Envelope:
        """A copy with ``values`` merged into the dict header ``name``."""
        current = self.headers.get(name)
        merged = {**(current if isinstance(current, dict) else {}), **values}
        return Envelope(self.body, self.content_type, self.content_encoding, self.exchange,
                        self.routing_key, {**self.headers, name: merged}, self.properties)

    def via(self, exchange: str, headers: dict[str, Any]) -> Envelope:
        """A copy published to ``exchange`` with ``headers`` instead of its own (its
        routing key unchanged)."""
        return Envelope(self.body, self.content_type, self.content_encoding, exchange,
                        self.routing_key, headers, self.properties)

    def to(self, routing_key: str) -> Envelope:
        """A copy addressed to ``routing_key``."""
        return Envelope(self.body, self.content_type, self.content_encoding, self.exchange,
                        routing_key, self.headers, self.properties)

    def publish(self, producer: Any, *, queues: Any = None,
                retry_policy: dict[str, Any] | None = None, retry: bool = True) -> None:
        """Publish the message as captured (a kombu ``Producer``); no ETA, no re-serializing.

        ``queues`` (Celery's ``app.amqp.queues``): the queues it goes to are declared with
        it, as ``apply_async`` declares its queue (cached by kombu per channel): the one
        its routing key names, or, published to an exchange, every queue bound to that
        exchange (a Redis broker routes by an exchange's type only once the publishing
        connection has declared it: an exchange it has not seen is taken as direct, and
        a topic or fanout route matches nothing).  ``retry``: kombu publishes the same
        message again after a connection error, per ``retry_policy``."""
        producer.publish(
            self.body, exchange=self.exchange, routing_key=self.routing_key,
            headers=self.headers, content_type=self.content_type,
            content_encoding=self.content_encoding, declare=self._declared(queues),
            retry=retry, retry_policy=retry_policy, **self.properties)

    def _declared(self, queues: Any) -> list[Any] | None:
        """The queues of ``queues`` this message goes to (None: none known, declare none)."""
        if queues is None:
            return None
        if not self.exchange:
            queue = queues.get(self.routing_key)
            return [queue] if queue is not None else None
        bound = [q for q in queues.values()
                 if q.exchange is not None and q.exchange.name == self.exchange]
        return bound or None


@contextlib.contextmanager
def confirmed_producer(app: Any) -> Iterator[Any]:
    """A producer whose publish returns only once the broker has the message.

    A task re-published to wait is acknowledged right after: published
    unconfirmed, a message a RabbitMQ node has not yet written when it dies
    is gone, and the task with it.  So on RabbitMQ (``amqp``) the producer's
    channel uses publisher confirms, from a pool of its own (kombu's, keyed by
    the connection's settings: the app's own pool keeps its settings).  A
    Redis broker's publish is a command Redis has answered: the app's pool.
    """
    confirming = _broker(app).confirming
    if confirming is None:
        with app.producer_or_acquire() as producer:
            yield producer
        return
    with pools.producers[confirming].acquire(block=True) as producer:
        yield producer


def ladder_of(app: Any) -> Ladder | None:
    """The delay ladder of ``app``'s broker (``ladder.py``); None where the broker is not
    RabbitMQ (a Redis broker's countdown is an ETA)."""
    return _broker(app).ladder


@dataclass(frozen=True, slots=True)
class _Broker:
    url: str
    confirming: Any  # the connection for confirmed re-publishes; None: not AMQP
    ladder: Ladder | None


# app -> what it needs of its broker for re-publishes, made once per app, broker URL and
# process: not a kombu Connection per re-publish.
_brokers: weakref.WeakKeyDictionary[Any, _Broker] = weakref.WeakKeyDictionary()


def _broker(app: Any) -> _Broker:
    url = app.conf.broker_url
    known = _brokers.get(app)
    if known is None or known.url != url:
        connection = app.connection_for_write()
        confirming = None
        if connection.transport.driver_type == "amqp":
            options = {**(connection.transport_options or {}), "confirm_publish": True}
            confirming = app.connection_for_write(transport_options=options)
        connection.release()
        known = _brokers[app] = _Broker(url, confirming,
                                        Ladder() if confirming is not None else None)
    return known


def in_line(record: str, stored: bytes) -> bytes:
    """What a task waiting in a limit's line stores: its dispatch ``record`` (JSON) and its
    ``stored`` envelope (:meth:`Envelope.dumps`), in one value (``lua/record.lua`` splits
    it on the server)."""
    return _RECORD + record.encode() + b"\n" + stored


def split_record(raw: bytes | str) -> tuple[bytes | None, bytes]:
    """A stored value's dispatch record (None for a parked task's plain envelope) and its
    envelope."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data[:1] != _RECORD:
        return None, data
    record, _, stored = data[1:].partition(b"\n")
    return record, stored


def _fields(raw: bytes | str) -> tuple[dict[str, Any], bytes]:
    """A stored envelope's fields and body, in any format (``ValueError`` if none)."""
    data = split_record(raw)[1]
    if data[:1] != _DEFLATED:
        raise ValueError(f"not a stored envelope (format byte {data[:1]!r})")
    try:
        unpacker = zlib.decompressobj(_WBITS, zdict=_DICTIONARY)
        plain = unpacker.decompress(data[1:]) + unpacker.flush()
    except zlib.error as exc:
        raise ValueError(f"not a stored envelope ({exc})") from None
    fields, _, body = plain.partition(b"\0")
    d = json.loads(fields)
    if not isinstance(d, dict):
        raise ValueError("not a stored envelope (not a JSON object)")
    return d, body


class _Recorder:
    """Stands in for kombu's Producer inside ``app.send_task``: records, sends nothing."""

    class _Connection:
        @contextlib.contextmanager
        def _reraise_as_library_errors(self) -> Iterator[None]:
            yield

        # Celery reads it where it retries a callback's publish itself (app/amqp.py).
        recoverable_connection_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, ignore_result: bool) -> None:
        self.connection = self._Connection()
        self.ignore_result = ignore_result
        self.published = 0  # every publish
        self.tasks: list[Envelope] = []  # those that are a task's message

    def publish(self, body: Any, *, exchange: Any = "", routing_key: str = "",
                serializer: str | None = None, compression: str | None = None,
                headers: dict[str, Any] | None = None, delivery_mode: Any = None,
                **options: Any) -> None:
        content_type, content_encoding, serialized = dumps(body, serializer=serializer)
        data = serialized if isinstance(serialized, bytes) else serialized.encode(content_encoding)
        headers = dict(headers or {})
        if "ignore_result" in headers:  # (protocol 2) as the signature has it: see capture()
            headers["ignore_result"] = self.ignore_result
        if compression:
            data, headers["compression"] = compress(data, compression)
        properties = {k: v for k, v in options.items()
                      if k not in _DROPPED and k not in ("retry", "retry_policy", "declare",
                                                         "timeout", "confirm_timeout")
                      and v is not None}
        if delivery_mode is not None:
            properties["delivery_mode"] = delivery_mode
        name = str(getattr(exchange, "name", exchange) or "")
        # A copy that came down the delay ladder goes back where it was first sent.
        envelope = Envelope(data, content_type, content_encoding, origin(name, headers),
                            routing_key or "", strip(headers), properties)
        self.published += 1
        if _is_task_message(body, headers):
            self.tasks.append(envelope)


def capture(signature: Any) -> Envelope:
    """What ``signature.apply_async()`` would publish, recorded instead of sent.

    Sent with ``ignore_result=True``, its message header then set back to the
    signature's own value: otherwise Celery's Redis result backend subscribes
    to the result of a message it never sends, where the pool lets tasks wait
    for results (gevent, eventlet, threads): a pub/sub subscription, and a
    backend made for it per green thread, kept per waiting task.
    """
    kept = signature.options.get("ignore_result")
    if kept is None:
        kept = bool(getattr(signature.type, "ignore_result", False))
    recorder = _Recorder(bool(kept))
    signature.apply_async(producer=recorder, ignore_result=True)
    if len(recorder.tasks) != 1:
        raise RuntimeError(
            f"cannot tell which of the {recorder.published} messages apply_async published "
            f"for {signature.task!r} is the task's own ({len(recorder.tasks)} look like a "
            f"task's; task_send_sent_event={signature.app.conf.task_send_sent_event!r}, "
            f"task_protocol={signature.app.conf.task_protocol!r}): the task cannot be copied "
            "to wait")
    return recorder.tasks[0]


def _is_task_message(body: Any, headers: dict[str, Any]) -> bool:
    """Is this publish a task's message?  Celery publishes others through the same producer
    (``task_send_sent_event``: the ``task-sent`` event, after the task's message).  A
    task's message names its task and id: in its headers (protocol 2) or its body
    (protocol 1); an event has neither (its fields are ``type``, ``uuid``, ``name``...)."""
    named = headers if "task" in headers else body
    return (isinstance(named, dict) and isinstance(named.get("task"), str)
            and isinstance(named.get("id"), str))
