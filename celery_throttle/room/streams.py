"""The ledger's log on a RabbitMQ broker: its records in streams, in generations.

A RabbitMQ stream is an append-only log of messages, durable like a quorum
queue, that consumers read from any point without removing anything.  The
ledger (``ledger.py``) appends its records to the stream of the current
*generation*; reading it back means appending a mark and reading every live
generation from its first record up to the mark (:meth:`StreamLog.read`).

A generation is never trimmed, only deleted whole, by a compaction
(:meth:`StreamLog.compact`): it begins a new generation, waits for the
writers to move to it, reads the old ones, appends to the new one what is
still live (puts) or still needed (recent takes) and deletes the old ones.
Which generations exist is itself kept in a small stream, the *index*, of
``begin`` and ``end`` records (``end g``: every generation up to ``g`` is
gone), trimmed by size only, so its last records are never lost.  Writers
learn the current generation from ``current()`` (the store's copy, set by a
compaction), else from the index; a writer still appending to a deleted
generation is refused by the broker (no route) and appends again to the
current one.

Names: ``celery_throttle.ledger.<prefix>`` (the index) and
``celery_throttle.ledger.<prefix>.<generation>``.  Every append is
confirmed by the broker before it returns (publisher confirms).  RabbitMQ
3.9 or later (streams over AMQP 0-9-1, no plugin).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from amqp import Message
from amqp.exceptions import ChannelError, NotFound

from ..core.logs import logger
from .ledger import Record, Replay, replay

__all__ = ["READ_TIMEOUT_S", "StreamLog", "index_name", "stream_name"]

T = TypeVar("T")

#: The longest one read of the log may take (seconds): past it, the read fails.
READ_TIMEOUT_S = 120.0
# Reads of the log started over at most (a generation deleted while it is read).
_READS = 5
# Records read per credit round (a stream consumer needs a prefetch count).
_PREFETCH = 1000
# The index is trimmed to this size (its records are tens of bytes), in segments of
# this size: only a whole segment is ever trimmed, never the last one.
_INDEX_BYTES = 1_000_000
_INDEX_SEGMENT_BYTES = 100_000
_STREAM = {"x-queue-type": "stream"}
_NO_ROUTE = 312  # a mandatory publish no queue took
# Refusals not tried again (:meth:`StreamLog._tried`): access refused, precondition failed (a
# broker without streams: RabbitMQ before 3.9), not allowed.
_REFUSED = (403, 406, 530)
# Pauses between two tries while the broker is unreachable (s).
_RETRY_FIRST_S = 0.2
_RETRY_MOST_S = 2.0


def index_name(prefix: str) -> str:
    """The stream listing ``prefix``'s generations."""
    return f"celery_throttle.ledger.{prefix}"


def stream_name(prefix: str, generation: int) -> str:
    """The stream of ``prefix``'s records of ``generation``."""
    return f"{index_name(prefix)}.{generation}"


def _message(record: Record) -> Message:
    headers: dict[str, Any] = {"op": record.op}
    for name in ("entry", "mark", "token"):
        if getattr(record, name):
            headers[name] = getattr(record, name)
    if record.at:
        headers["at"] = record.at
    return Message(record.value, application_headers=headers, delivery_mode=2)


def _record(message: Any) -> Record:
    headers = message.headers or {}

    def text(name: str) -> str:
        value = headers.get(name, "")
        return value.decode() if isinstance(value, bytes) else str(value)

    body = message.body
    return Record(text("op"), text("entry"), mark=text("mark"),  # type: ignore[arg-type]
                  token=text("token"), at=int(headers.get("at") or 0),
                  value=body if isinstance(body, bytes) else str(body).encode())


class StreamLog:
    """One key prefix's ledger on a RabbitMQ broker (the module docstring)."""

    def __init__(self, connect: Callable[[], Any], prefix: str, *,
                 current: Callable[[], int | None] = lambda: None,
                 refresh_s: float = 5.0, retry_s: float = 60.0) -> None:
        """``connect()``: a new kombu ``Connection`` to the broker, with publisher confirms
        (``transport_options={"confirm_publish": True}``); ``current()``: the current
        generation as the store knows it (None: unknown, the index says), asked again
        every ``refresh_s`` seconds; ``retry_s``: how long an append, a read or a
        deletion is tried again while the broker is unreachable."""
        self.connect = connect
        self.prefix = prefix
        self.current = current
        self.refresh_s = refresh_s
        self.retry_s = retry_s
        self.index = index_name(prefix)
        self._conn: Any = None
        self._pid = 0
        self._generation = 0
        self._checked = 0.0
        self._lock = threading.RLock()  # (one connection per process, for every thread)

    # -- the connection ------------------------------------------------------------------

    def _channel(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            # (A forked child never uses its parent's socket.)
            self._conn, self._pid = self.connect(), os.getpid()
            self._conn.ensure_connection(max_retries=1)
        return self._conn.default_channel

    def _reset(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            try:
                conn.close()
            except Exception:  # (already broken: nothing to save)
                logger.debug("celery_throttle: closing the ledger's connection failed",
                             exc_info=True)

    def close(self) -> None:
        """Close this process's connection (another is opened when needed)."""
        with self._lock:
            self._reset()

    def _declare(self, channel: Any, name: str, index: bool = False) -> None:
        arguments: dict[str, str | int] = dict(_STREAM)
        if index:
            arguments.update({"x-max-length-bytes": _INDEX_BYTES,
                              "x-stream-max-segment-size-bytes": _INDEX_SEGMENT_BYTES})
        channel.queue_declare(name, durable=True, auto_delete=False, arguments=arguments)

    # -- generations ---------------------------------------------------------------------

    def generations(self) -> list[int]:
        """The live generations, oldest first (one is begun if there is none)."""
        return self._tried(self._listed)

    def _listed(self) -> list[int]:
        found = self._generations()
        if not found:
            self._begin(1)
            found = [1]
        return found

    def _generations(self) -> list[int]:
        channel = self._channel()
        self._declare(channel, self.index, index=True)
        begun: set[int] = set()
        ended = 0
        for headers in self._read_headers(self.index):
            op, generation = headers.get("op"), int(headers.get("gen") or 0)
            if op in ("begin", b"begin"):
                begun.add(generation)
            elif op in ("end", b"end"):
                ended = max(ended, generation)
        return sorted(g for g in begun if g > ended)

    def _begin(self, generation: int) -> None:
        channel = self._channel()
        self._declare(channel, stream_name(self.prefix, generation))
        channel.basic_publish(Message(b"", application_headers={"op": "begin",
                                                                "gen": generation},
                                      delivery_mode=2), exchange="", routing_key=self.index)

    def generation(self) -> int:
        """The generation appends go to now."""
        return self._tried(self._now_appended)

    def _now_appended(self) -> int:
        now = time.monotonic()
        if not self._generation or now - self._checked >= self.refresh_s:
            try:
                known = self.current()
            except Exception:  # (the store is down: the last one known, else the index)
                known = self._generation
            self._generation = known if known else self._listed()[-1]
            self._checked = now
        return self._generation

    # -- writing -------------------------------------------------------------------------

    def append(self, records: Sequence[Record], patience: float | None = None) -> None:
        """Append ``records`` to the current generation, in order; return once the broker
        has confirmed them all (tried again as :meth:`_tried` says, for ``patience``
        seconds rather than ``retry_s`` if given).  (Appended twice, a record means what it
        meant once: ``ledger.py``.)"""
        self._tried(lambda: self._append(records), patience)

    def _tried(self, action: Callable[[], T], patience: float | None = None) -> T:
        """``action()``, tried again on a new connection for up to ``retry_s`` (or
        ``patience``) seconds while the broker is unreachable or a stream not ready, then
        raising; a refusal raises now."""
        deadline = time.monotonic() + (self.retry_s if patience is None else patience)
        pause = _RETRY_FIRST_S
        with self._lock:
            while True:
                try:
                    return action()
                except Exception as exc:
                    if isinstance(exc, ChannelError) and exc.reply_code in _REFUSED:
                        self._reset()
                        raise  # (no right to the stream, or no streams on this broker)
                    if isinstance(exc, ChannelError) and exc.reply_code == _NO_ROUTE \
                            and time.monotonic() < deadline:
                        # Its generation was deleted (a compaction, a purge): on to the
                        # current one, as the index says (the store's copy may be older).
                        with contextlib.suppress(Exception):
                            self._generation = self._listed()[-1]
                            self._checked = time.monotonic()
                            continue
                    # The connection is lost; or a stream is not back yet after the
                    # broker's restart ("down or inaccessible"), or not started yet just
                    # after its declaration ("stream not found", an internal error when
                    # two nodes declare it at once): the next try connects again.
                    self._reset()
                    if time.monotonic() + pause > deadline:
                        raise
                    time.sleep(pause)
                    pause = min(pause * 2, _RETRY_MOST_S)

    def _append(self, records: Sequence[Record], generation: int = 0) -> None:
        channel = self._channel()
        name = stream_name(self.prefix, generation or self._now_appended())
        for record in records:
            channel.basic_publish(_message(record), exchange="", routing_key=name,
                                  mandatory=True)

    # -- reading -------------------------------------------------------------------------

    def read(self) -> Replay:
        """Everything appended before this call, replayed (every live generation, oldest
        first, each read up to a mark appended to it now)."""
        return self._tried(lambda: self._replay(0))

    def _replay(self, below: int) -> Replay:
        """Every live generation (only those before ``below``, unless 0), replayed.  One
        deleted meanwhile (a compaction carried it into a new one first) starts it over."""
        for _ in range(_READS):
            found = Replay()
            for generation in self._generations():
                if below and generation >= below:
                    continue
                records = self._read(stream_name(self.prefix, generation))
                if records is None:
                    break
                replay(records, into=found)
            else:
                return found
        raise RuntimeError(f"the ledger's generations kept changing over {_READS} reads")

    def _read(self, name: str) -> list[Record] | None:
        """The records of stream ``name`` (None: it was deleted)."""
        messages = self._read_messages(name)
        return None if messages is None else [_record(m) for m in messages]

    def _read_headers(self, name: str) -> list[dict[str, Any]]:
        return [m.headers or {} for m in self._read_messages(name) or ()]

    def _read_messages(self, name: str) -> list[Any] | None:
        """Every message of stream ``name`` before a mark appended now (not the mark);
        None when there is no such stream."""
        channel = self._channel()
        token = secrets.token_hex(8)
        try:
            channel.basic_publish(Message(b"", application_headers={"op": "mark",
                                                                    "token": token},
                                          delivery_mode=2),
                                  exchange="", routing_key=name, mandatory=True)
        except ChannelError as exc:
            if exc.reply_code == _NO_ROUTE:
                return None
            raise  # (not "no such stream": not started yet, say; the caller tries again)
        reader = self._conn.channel()
        found: list[Any] = []
        done = [False]

        def take(message: Any) -> None:
            if done[0]:
                return
            headers = message.headers or {}
            if headers.get("op") in ("mark", b"mark") and headers.get("token") in (
                    token, token.encode()):
                done[0] = True
            else:
                found.append(message)
            if done[0] or len(found) % (_PREFETCH // 2) == 0:
                reader.basic_ack(message.delivery_tag, multiple=True)

        try:
            reader.basic_qos(0, _PREFETCH, False)
            tag = reader.basic_consume(name, callback=take,
                                       arguments={"x-stream-offset": "first"})
            deadline = time.monotonic() + READ_TIMEOUT_S
            while not done[0]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"reading the ledger's stream {name!r} took over "
                                       f"{READ_TIMEOUT_S:.0f}s")
                try:
                    self._conn.drain_events(timeout=min(left, 1.0))
                except TimeoutError:
                    continue
            # Records appended after the mark are still on their way: the cancel takes
            # them in (ignored) before its answer, so the close finds none in flight.
            reader.basic_cancel(tag)
        finally:
            reader.close()
        return found

    # -- compaction ----------------------------------------------------------------------

    def compact(self, *, switch_s: float, keep_takes_ms: int,
                on_begun: Callable[[int], None] = lambda generation: None,
                now_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> int:
        """Begin a new generation and move what is still needed there; delete the old
        ones.  ``on_begun(g)`` (the store learns the new generation) is called once it
        exists; writers move to it within ``switch_s`` seconds (their refresh); takes
        younger than ``keep_takes_ms`` are kept.  Returns the new generation."""
        with self._lock:
            old = self._generations()
            new = (old[-1] if old else 0) + 1
            self._begin(new)
            # The one after it is declared now, a period before it is used: RabbitMQ may
            # not start again a stream it was killed within about 2 s of declaring.
            self._declare(self._channel(), stream_name(self.prefix, new + 1))
            self._generation, self._checked = new, time.monotonic()
        on_begun(new)
        time.sleep(switch_s)  # (the writers' lock is not held meanwhile)
        with self._lock:
            found = self._replay(new)
            since = now_ms() - keep_takes_ms
            carried = [Record("take", entry, token=token, at=at)
                       for entry, (token, at) in found.taken.items() if at >= since]
            carried += [Record("put", entry, mark=mark, value=value)
                        for entry, (mark, value) in found.live.items()]
            self._append(carried, new)
            if old:
                self._channel().basic_publish(
                    Message(b"", application_headers={"op": "end", "gen": old[-1]},
                            delivery_mode=2), exchange="", routing_key=self.index)
                for generation in old:
                    try:
                        self._channel().queue_delete(stream_name(self.prefix, generation))
                    except NotFound:
                        self._reset()  # (the channel closes on a 404)
            return new

    def delete(self) -> None:
        """Delete every generation and the index (the waiting room was purged)."""
        def delete() -> None:
            found = self._generations()
            for generation in [*found, (found[-1] if found else 0) + 1]:  # (and the next)
                self._channel().queue_delete(stream_name(self.prefix, generation))
            self._channel().queue_delete(self.index)
            self._generation = 0

        self._tried(delete)

    def __repr__(self) -> str:
        return f"StreamLog(prefix={self.prefix!r})"
