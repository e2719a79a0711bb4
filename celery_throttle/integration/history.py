"""The last 15 minutes of every limit, per second: what the workers did, kept in the store.

Each worker process counts its decisions in memory (``metrics.py``: admitted,
deferred, the waits given, provider pauses, store errors) and a thread of
:class:`CountsWriter` adds them, once a second, to one hash per second,
``{<prefix>}:counts:<unix second>`` (``<field>:<limit name>`` -> count), which
expires after :data:`KEPT` seconds.  The decision's path gains a dictionary
update, no store call: the writer costs each busy process one pipelined call
per second, whatever the rate (BENCHMARKS.md section 6 has its cost).  :func:`read_counts`
reads a span of seconds back, summed over every process and machine, for the
dashboard.

Seconds are the workers' wall clocks: a machine whose clock is off files its
counts under its own second.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable

import redis
from redis.cluster import RedisCluster

from .. import metrics
from ..core.keys import counts_key
from ..core.logs import logger
from ..values import text

__all__ = ["FIELDS", "KEPT", "SPAN", "CountsWriter", "read_counts"]

#: The last seconds the dashboard charts and ``status`` sums (15 minutes).
SPAN = 900
#: How long (seconds) a second's counts stay in the store: the span, and a margin
#: for a late writer and clocks that differ.
KEPT = 960
#: The counted fields (``metrics.LimitStats``'s names).
FIELDS = ("admitted", "deferred", "wait_seconds_sum", "provider_pauses", "store_errors",
          "would_defer", "would_wait_seconds_sum")
_EVERY = 1.0
_writer: CountsWriter | None = None  # the one writer taking this process's counts


class CountsWriter:
    """Adds this process's counts per second to the store, from a daemon thread.

    :meth:`start` once per process (idempotent; a forked child starts its own);
    :meth:`stop` writes what is left.  A store that does not answer loses those
    seconds' counts, never the decisions.  The counts are the process's
    (``metrics.py``), so one writer takes them: the last one started (a process
    serving two apps files every count under the prefix of the last one that
    admitted a task first).
    """

    def __init__(self, client: redis.Redis | RedisCluster, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        # One write at a time: a caller's write() returns once every count taken before
        # it is in the store, also those the thread took a moment earlier.
        self._writing = threading.Lock()

    def start(self) -> None:
        """Keep counts per second and write them every second from now on."""
        if self._thread is not None:
            return
        global _writer
        with self._lock:
            if self._thread is None:
                _writer = self
                metrics.keep_seconds(True)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="celery_throttle-counts")
                self._thread.start()

    def stop(self) -> None:
        """Write what is counted and stop the thread."""
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        self.write()

    def write(self) -> int:
        """Add the counts taken so far to the store now; returns how many seconds."""
        with self._writing:
            taken = metrics.take_seconds()
            if not taken:
                return 0
            pipe = self.client.pipeline(transaction=False)
            for second, counts in taken.items():
                key = counts_key(self.prefix, second)
                for (field, name), n in counts.items():
                    pipe.hincrbyfloat(key, f"{field}:{name}", n)
                pipe.expire(key, KEPT)
            try:
                pipe.execute()
            except redis.RedisError as exc:
                logger.debug("throttle: counts of %d second(s) not written: %s", len(taken),
                             type(exc).__name__)
            return len(taken)

    def _run(self) -> None:
        while not self._stopped.wait(_EVERY) and _writer is self:
            with contextlib.suppress(Exception):  # the writer never ends a worker
                self.write()


def read_counts(client: redis.Redis | RedisCluster, prefix: str, seconds: Iterable[int]
                ) -> dict[int, dict[str, dict[str, float]]]:
    """The counts of ``seconds``: ``{second: {limit: {field: n}}}`` (seconds with none left out)."""
    wanted = list(seconds)
    pipe = client.pipeline(transaction=False)
    for second in wanted:
        pipe.hgetall(counts_key(prefix, second))
    found: dict[int, dict[str, dict[str, float]]] = {}
    for second, raw in zip(wanted, pipe.execute() if wanted else [], strict=True):
        for k, v in (raw or {}).items():
            field, _, name = text(k).partition(":")
            if field in FIELDS and name:
                found.setdefault(second, {}).setdefault(name, {})[field] = float(text(v))
    return found

