"""Pool process memory: a deferral's garbage is collected before the next run, once frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from celery_throttle.integration import memory


class _Cycle:
    """A reference cycle, as Celery's ExceptionInfo and its frames make one."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def fresh() -> Iterator[None]:
    """Module state as a new pool process has it; the collector unfrozen afterwards."""
    memory._frozen, memory._pending = False, False
    gc.disable()  # only the calls under test collect
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        memory._frozen, memory._pending = False, False


def _garbage() -> weakref.ref[_Cycle]:
    cycle = _Cycle()
    return weakref.ref(cycle)  # the cycle itself is unreachable once this returns


@pytest.mark.usefixtures("fresh")
def test_frozen_process_collects_after_a_deferral() -> None:
    memory.freeze_inherited()
    assert gc.get_freeze_count() > 0
    left = _garbage()
    memory.deferred()
    assert left() is not None  # still waiting for the collector
    memory.collect_after_deferral()
    assert left() is None
    again = _garbage()
    memory.collect_after_deferral()  # nothing pending: no collection
    assert again() is not None


@pytest.mark.usefixtures("fresh")
def test_unfrozen_process_never_collects_on_the_tasks_path() -> None:
    """Without the freeze a full collection walks every object: not on a task's path."""
    left = _garbage()
    memory.deferred()
    memory.collect_after_deferral()
    assert left() is not None
