"""An operating-system thread and its stop signal, even where gevent or eventlet patched threads.

The dispatcher keeps the time of every waiting task on its node.  Under
``-P gevent`` or ``-P eventlet`` a patched ``threading.Thread`` is a green
thread, run by the same loop as the pool's task greenlets and the consumer,
so it wakes and gets its replies only when that loop gets round to it: a
busy pool makes every dispatch late, where a thread of its own keeps time.
A thread started with
the original ``_thread`` runs beside the loop; its calls on patched sockets
block on a hub of that thread (gevent and eventlet each keep one per thread).
Nothing it uses may be shared with the loop's greenlets: it makes its own
store client and broker connection.
"""

from __future__ import annotations

import _thread
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["NativeThread", "patched"]


def patched() -> str | None:
    """The library that patched ``threading`` in this process ("gevent", "eventlet"), or None."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return "gevent"
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        return "eventlet"
    return None


class _Originals:
    def __init__(self, start_new_thread: Callable[..., Any],
                 allocate_lock: Callable[[], Any]) -> None:
        self.start_new_thread, self.allocate_lock = start_new_thread, allocate_lock


def _originals(library: str | None) -> _Originals:
    """``_thread``'s thread start and lock as they were before ``library`` patched them."""
    if library == "gevent":
        from gevent import monkey

        return _Originals(monkey.get_original("_thread", "start_new_thread"),
                          monkey.get_original("_thread", "allocate_lock"))
    if library == "eventlet":
        from eventlet import patcher

        original = patcher.original("_thread")
        return _Originals(original.start_new_thread, original.allocate_lock)
    return _Originals(_thread.start_new_thread, _thread.allocate_lock)


class NativeThread:
    """Runs ``target(thread)`` in an OS thread; :meth:`stop` asks it to end, :meth:`wait`
    sleeps in it until then."""

    def __init__(self, target: Callable[[NativeThread], None], name: str) -> None:
        self._target, self.name = target, name
        library = patched()
        originals = _originals(library)
        self._green = library is not None
        # Locks of the original kind: held while running / until stopped.
        self._running = originals.allocate_lock()
        self._stopping = originals.allocate_lock()
        self._stopping.acquire()
        self._start_new_thread = originals.start_new_thread
        self._stopped = False

    def start(self) -> None:
        """Start the thread."""
        self._running.acquire()
        if self._green:
            self._start_new_thread(self._main, ())
        else:  # a named thread (thread dumps and log records show it)
            threading.Thread(target=self._main, name=self.name, daemon=True).start()

    def _main(self) -> None:
        try:
            self._target(self)
        finally:
            self._running.release()

    @property
    def stopped(self) -> bool:
        """Has :meth:`stop` been called."""
        return self._stopped

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` (in the thread), or until :meth:`stop`; True if stopped."""
        if self._stopped:
            return True
        if self._stopping.acquire(timeout=max(seconds, 0.0)):
            self._stopping.release()
        return self._stopped

    def stop(self) -> None:
        """Ask the thread to end (it sees :attr:`stopped`; its :meth:`wait` returns)."""
        if not self._stopped:
            self._stopped = True
            self._stopping.release()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True if it did."""
        if self._running.acquire(timeout=timeout):
            self._running.release()
            return True
        return False

    def is_alive(self) -> bool:
        """Is the thread running."""
        return bool(self._running.locked())
