"""Waiting tasks kept in a log on a RabbitMQ broker, where the store alone would lose them.

The RabbitMQ counterpart of ``keeper.py``: the waiting itself stays in the
store (lines, turns, the dispatch), and every waiting task is also recorded
in the ledger (``ledger.py``), a log kept by the broker in streams
(``streams.py``), read back only when the store comes back without its data:

* a task starts to wait: its ``put`` is appended (and confirmed) first, then
  it is written to the store; a failed store write appends its ``drop``;
* a kept copy arrives at a worker: its ``take`` is appended, then the store
  decides as it always does (the first copy of an entry goes on).  A copy
  dispatched before the store's loss (its epoch is not the store's) first
  waits for the restore, so that its take comes after the restore's read:
  its entry is then back in line, and taking it there is what counts;
* the store comes back empty (a new epoch): a dispatcher reads the ledger
  and writes every live task back where it waited (:meth:`LoggedKeeper.restore`,
  as ``Keeper.restore``), and for each recently taken one the marker of the
  copy that took it (``lua/arrive.lua``: that copy, or its redelivery, goes
  on; any other is refused).  The store remembers the epoch restored for;
* every :data:`COMPACT_S`, one node's dispatcher compacts the ledger (in a
  thread of its own: ``StreamLog.compact``), so it holds about what waits.

Keys in the store: ``ledger:restored`` (the epoch restored for),
``ledger:gen`` (the ledger's current generation) and ``ledger:compacting``
(set by the node that compacts, for :data:`COMPACT_S`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from ..core.keys import epoch_key
from ..core.logs import logger
from ..values import text
from .keeper import RESTORE_BATCH
from .keys import arrival_marker, room_key
from .ledger import Record
from .streams import StreamLog

__all__ = ["COMPACT_S", "IMPATIENT_S", "RESTORE_WAIT_S", "LedgerUnavailable",
           "LoggedKeeper"]

#: Seconds between two compactions of the ledger (one node at a time).
COMPACT_S = 300.0
#: The longest a copy dispatched before the store's loss waits for the restore (s).
RESTORE_WAIT_S = 60.0
#: The longest a write made in the worker's main process tries the log (s): that thread
#: also consumes the broker's messages and runs the worker's shutdown, which a broker
#: gone for good would otherwise hold up for the whole ``retry_s``.
IMPATIENT_S = 1.0
# How often a writer asks the store for the ledger's current generation (s), and
# how long a compaction waits for every writer to have moved to the new one.
_REFRESH_S = 5.0
_SWITCH_S = 3 * _REFRESH_S
# How often this node's dispatcher sees whether a compaction is due (s).
_CHECK_S = 30.0
_POLL_S = 0.05


class LedgerUnavailable(redis.ConnectionError):
    """The log on the broker could not be written (the broker down longer than an append
    retries, or refusing the stream).  A ``redis.ConnectionError``, as a failure of the
    keeper beside a Redis broker is: callers handle it as a failed write of the waiting
    room (the task waits as a countdown instead, or the store-down policy applies)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class LoggedKeeper:
    """The waiting tasks of one key prefix, kept in a log on the RabbitMQ broker."""

    def __init__(self, store: Any, connect: Callable[[], Any], prefix: str, *,
                 marker_ttl_ms: int, switch_s: float = _SWITCH_S,
                 retry_s: float = 60.0) -> None:
        """``store``: a client of the store (its own); ``connect()``: a new kombu
        ``Connection`` to the broker with publisher confirms; ``marker_ttl_ms``: how long
        a taken entry's copy may still come (a redelivery), so its take is kept;
        ``switch_s``: how long a compaction waits for the writers to move on; ``retry_s``:
        how long an append is tried again while the broker is unreachable."""
        self.client = store
        self.prefix = prefix
        self.marker_ttl_ms = marker_ttl_ms
        self.switch_s = switch_s
        self.restored = room_key(prefix, "ledger:restored")
        self.current = room_key(prefix, "ledger:gen")
        self.compacting = room_key(prefix, "ledger:compacting")
        self.connect = connect
        self.log = StreamLog(connect, prefix, current=self._generation, refresh_s=_REFRESH_S,
                             retry_s=retry_s)
        self._checked = 0.0
        self._compactor: threading.Thread | None = None

    def _generation(self) -> int | None:
        raw = self.client.get(self.current)
        return int(raw) if raw else None

    def put(self, entry: str, value: bytes, *, patient: bool = True) -> str | None:
        """Append ``entry``'s put; its mark (for :meth:`drop`).  Not ``patient``: the log
        is tried for :data:`IMPATIENT_S` at most."""
        mark = secrets.token_hex(8)
        self._append(Record("put", entry, mark=mark, value=value), patient)
        return mark

    def drop(self, entry: str, handle: str, *, patient: bool = True) -> None:
        """Append the drop of the put marked ``handle``.  Not ``patient`` and not written
        within :data:`IMPATIENT_S`: tried on in a thread of its own, for ``retry_s``."""
        record = Record("drop", entry, mark=handle)
        try:
            self._append(record, patient)
        except LedgerUnavailable:
            if patient:
                raise
            # Until this drop lands, the put stands: a restore would bring back a task
            # that never waited (the pool runs it now).  Its own connection: this log's
            # lock is not held through the tries.
            threading.Thread(target=self._drop_later, args=(record,), daemon=True,
                             name="celery-throttle-ledger-drop").start()

    def _drop_later(self, record: Record) -> None:
        log = StreamLog(self.connect, self.prefix, current=self._generation,
                        retry_s=self.log.retry_s)
        try:
            log.append([record])
        except Exception as exc:
            logger.warning("throttle: a drop could not be written to the waiting tasks' log "
                           "(%s: %s): a later loss of the store brings back a task that did "
                           "not wait there", type(exc).__name__, exc)
        finally:
            log.close()

    def take(self, entry: str, token: str, epoch: int, *, patient: bool = True) -> int:
        """Append the take of ``entry`` by the copy ``token`` (dispatched in ``epoch``);
        -1: the store decides.  A copy from before the store's loss waits for the
        restore first (at most :data:`RESTORE_WAIT_S`; not ``patient``, it fails at
        once: the take would have to wait)."""
        self._await_restore(epoch, RESTORE_WAIT_S if patient else 0.0)
        self._append(Record("take", entry, token=token, at=_now_ms()), patient)
        return -1

    def _append(self, record: Record, patient: bool) -> None:
        try:
            self.log.append([record], patience=None if patient else IMPATIENT_S)
        except redis.RedisError:
            raise
        except Exception as exc:
            raise LedgerUnavailable(f"the waiting tasks' log on the broker: "
                                    f"{type(exc).__name__}: {exc}") from exc

    def _await_restore(self, epoch: int, patience: float) -> None:
        deadline = time.monotonic() + patience
        while True:
            current, restored = self.client.mget([epoch_key(self.prefix), self.restored])
            if current is not None and (text(current) == str(epoch) or current == restored):
                return
            if not patience:
                raise LedgerUnavailable("the waiting tasks' log is not restored yet")
            if time.monotonic() >= deadline:
                logger.warning("throttle: the store came back without its data and no node "
                               "restored the waiting tasks within %.0fs; a copy dispatched "
                               "before goes on as if they were", RESTORE_WAIT_S)
                return
            time.sleep(_POLL_S)

    def count(self) -> int | None:
        """Not counted: that would read the whole log."""
        return None

    def clear(self) -> None:
        """Delete the log (the waiting room was purged)."""
        self.log.delete()
        self.client.delete(self.current)

    def restored_for(self) -> str:
        """The store epoch the ledger was last restored for ("" never)."""
        return text(self.client.get(self.restored) or b"")

    def restore(self, epoch: str, park: Callable[[list[tuple[str, bytes]]], None]) -> int:
        """Hand every waiting task the ledger has to ``park`` (batches of (entry, value)),
        mark each recently taken one with the copy that took it, and note ``epoch``."""
        # (On a connection of its own: the puts of this process's arrivals go on.)
        reader = StreamLog(self.connect, self.prefix, current=self._generation,
                           retry_s=self.log.retry_s)
        try:
            found = reader.read()
        finally:
            reader.close()
        live = [(entry, value) for entry, (_, value) in found.live.items()]
        for i in range(0, len(live), RESTORE_BATCH):
            park(live[i:i + RESTORE_BATCH])
        since = _now_ms() - self.marker_ttl_ms
        taken = [(entry, token) for entry, (token, at) in found.taken.items() if at >= since]
        for i in range(0, len(taken), RESTORE_BATCH):
            pipe = self.client.pipeline(transaction=False)
            for entry, token in taken[i:i + RESTORE_BATCH]:
                # (Only where no copy went on since: the store's own marker wins.)
                pipe.set(arrival_marker(self.prefix, entry), token,
                         px=self.marker_ttl_ms, nx=True)
            pipe.execute()
        self.client.set(self.current, self.log.generation())
        self.client.set(self.restored, epoch)
        return len(live)

    def maintain(self) -> None:
        """Compact the ledger in a thread of its own if it is due (and this node's turn)."""
        now = time.monotonic()
        if now - self._checked < _CHECK_S or (self._compactor is not None
                                              and self._compactor.is_alive()):
            return
        self._checked = now
        if not self.client.set(self.compacting, secrets.token_hex(4), nx=True,
                               px=int(COMPACT_S * 1000)):
            return
        self._compactor = threading.Thread(target=self._compact, daemon=True,
                                           name="celery-throttle-ledger")
        self._compactor.start()

    def compacted(self, timeout: float) -> bool:
        """Wait for this node's compaction, if one runs; True when none runs (any more)."""
        if self._compactor is not None:
            self._compactor.join(timeout)
        return self._compactor is None or not self._compactor.is_alive()

    def _compact(self) -> None:
        compactor = StreamLog(self.connect, self.prefix, current=self._generation,
                              retry_s=self.log.retry_s)
        try:
            generation = compactor.compact(
                switch_s=self.switch_s, keep_takes_ms=self.marker_ttl_ms,
                on_begun=lambda g: self.client.set(self.current, g))
            logger.debug("throttle: the ledger was compacted into generation %d", generation)
        except Exception as exc:  # (tried again by a node at the next period)
            logger.warning("throttle: compacting the ledger failed: %s: %s",
                           type(exc).__name__, exc)
        finally:
            compactor.close()

    def close(self) -> None:
        """Close the clients (another is opened when needed)."""
        self.log.close()
        self.client.close()

    def __repr__(self) -> str:
        return f"LoggedKeeper(prefix={self.prefix!r})"
