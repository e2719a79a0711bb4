"""A task's message, serialized as Celery would publish it, to be published later as is.

:func:`capture` runs Celery's own publishing path (``apply_async``: routing,
options, protocol-2 headers, the task's serializer and compression) with a
stand-in producer that records the publish instead of sending it.  The
dispatcher later publishes the recorded body, headers and routing unchanged
with a real producer: the task's arguments are never deserialized outside
the worker that runs it, whatever the serializer (json, pickle, msgpack).
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kombu.compression import compress
from kombu.serialization import dumps

__all__ = ["Envelope", "capture"]

# Properties not replayed: "expiration" is relative to the capture (the
# worker checks the `expires` header itself when the message arrives).
_DROPPED = frozenset({"expiration"})


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

    def dumps(self) -> bytes:
        """The envelope as JSON (the body base64-encoded: it may be pickle or msgpack)."""
        return json.dumps({
            "b": base64.b64encode(self.body).decode("ascii"), "ct": self.content_type,
            "ce": self.content_encoding, "x": self.exchange, "rk": self.routing_key,
            "h": self.headers, "p": self.properties,
        }, default=str, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes | str) -> Envelope:
        """Read an envelope written by :meth:`dumps`."""
        d = json.loads(raw)
        return cls(base64.b64decode(d["b"]), d["ct"], d["ce"], d["x"], d["rk"], d["h"], d["p"])

    def with_header(self, name: str, **values: Any) -> Envelope:
        """A copy with ``values`` merged into the dict header ``name``."""
        current = self.headers.get(name)
        merged = {**(current if isinstance(current, dict) else {}), **values}
        return Envelope(self.body, self.content_type, self.content_encoding, self.exchange,
                        self.routing_key, {**self.headers, name: merged}, self.properties)

    def to(self, routing_key: str) -> Envelope:
        """A copy addressed to ``routing_key``."""
        return Envelope(self.body, self.content_type, self.content_encoding, self.exchange,
                        routing_key, self.headers, self.properties)

    def publish(self, producer: Any, *, declare: list[Any] | None = None,
                retry_policy: dict[str, Any] | None = None) -> None:
        """Publish the message as captured (a kombu ``Producer``); no ETA, no re-serializing."""
        producer.publish(
            self.body, exchange=self.exchange, routing_key=self.routing_key,
            headers=self.headers, content_type=self.content_type,
            content_encoding=self.content_encoding, declare=declare,
            retry=True, retry_policy=retry_policy, **self.properties)


class _Recorder:
    """Stands in for kombu's Producer inside ``app.send_task``: records, sends nothing."""

    class _Connection:
        @contextlib.contextmanager
        def _reraise_as_library_errors(self) -> Iterator[None]:
            yield

    def __init__(self) -> None:
        self.connection = self._Connection()
        self.sent: Envelope | None = None

    def publish(self, body: Any, *, exchange: Any = "", routing_key: str = "",
                serializer: str | None = None, compression: str | None = None,
                headers: dict[str, Any] | None = None, delivery_mode: Any = None,
                **options: Any) -> None:
        content_type, content_encoding, serialized = dumps(body, serializer=serializer)
        data = serialized if isinstance(serialized, bytes) else serialized.encode(content_encoding)
        headers = dict(headers or {})
        if compression:
            data, headers["compression"] = compress(data, compression)
        properties = {k: v for k, v in options.items()
                      if k not in _DROPPED and k not in ("retry", "retry_policy", "declare",
                                                         "timeout", "confirm_timeout")
                      and v is not None}
        if delivery_mode is not None:
            properties["delivery_mode"] = delivery_mode
        name = getattr(exchange, "name", exchange) or ""
        self.sent = Envelope(data, content_type, content_encoding, str(name), routing_key or "",
                             headers, properties)


def capture(signature: Any) -> Envelope:
    """What ``signature.apply_async()`` would publish, recorded instead of sent."""
    recorder = _Recorder()
    signature.apply_async(producer=recorder)
    if recorder.sent is None:  # pragma: no cover - Celery always publishes once
        raise RuntimeError("apply_async published nothing")
    return recorder.sent
