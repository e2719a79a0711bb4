"""A pool process's memory: the garbage every deferral leaves, collected before it piles up.

Every task that waits outside the worker ends its run with Celery's
``Ignore``, which Celery wraps in two ``ExceptionInfo`` objects: picklable
copies of every frame with its code's positions (most of it in Celery's own
tracer frame), left as cyclic garbage in the collector's oldest generation.
Python collects that generation only when it has grown by a quarter, and a
pool process starts with tens of thousands of objects in it: a backlog
deferred at pace leaves a hundred or more copies waiting for collection at
any time, and each process grows by that much garbage (BENCHMARKS.md
section 3, "Memory of pool processes", measures it with the setting on and
off).

So, with ``throttle_gc_freeze`` (the default), each pool process freezes
what it inherited at its start (those objects live as long as it does, and
frozen, the collector no longer writes to pages shared with the parent), and
the first gated run after a deferral collects the garbage: a full
collection of the unfrozen objects only, which is cheap, and keeps each
process near its starting size.  Frozen objects are never collected as
cycles.
"""

from __future__ import annotations

import gc

__all__ = ["collect_after_deferral", "deferred", "freeze_inherited"]

# This process's state, in one place: whether its collector was frozen here
# (collecting is cheap only then) and whether a deferral left garbage since
# the last collection.  No lock: in the threads pool two threads may race on
# the flag, and the worst case is one collection too many or one deferral's
# garbage left for the next.
_frozen = False
_pending = False


def freeze_inherited() -> None:
    """At a pool process's start: freeze the inherited objects, then reset the collector's count."""
    global _frozen
    gc.freeze()
    gc.collect()  # sets the oldest generation's size to what is left: next to nothing
    _frozen = True


def deferred() -> None:
    """A run just ended with ``Ignore`` (its task waits outside the worker)."""
    global _pending
    _pending = _frozen


def collect_after_deferral() -> None:
    """Collect the garbage the last deferral left, once (a no-op unless frozen and pending)."""
    global _pending
    if _pending:
        _pending = False
        gc.collect()
