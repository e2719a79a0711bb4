"""The dispatcher's thread is an operating-system thread under gevent and eventlet too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from celery_throttle.room.native import NativeThread, patched

# Run in a fresh interpreter: patching is for the whole process.  The main
# (green) thread spins without yielding for 0.4 s; a green thread would not run
# meanwhile, an OS thread ticks every 10 ms.  Then stop() ends its wait at once.
_SCRIPT = """
import {library}
{patch}
import time
from celery_throttle.room.native import NativeThread, patched

ticks = []
def run(thread):
    while not thread.stopped:
        ticks.append(1)
        thread.wait(0.01)

t = NativeThread(run, "probe")
t.start()
end = time.perf_counter() + 0.4
while time.perf_counter() < end:
    pass
during = len(ticks)
began = time.perf_counter()
t.stop()
ended = t.join(2.0)
print(patched(), during, ended, round(time.perf_counter() - began, 3), t.is_alive())
"""


@pytest.mark.parametrize(("library", "patch"), [
    ("gevent", "from gevent import monkey; monkey.patch_all()"),
    ("eventlet", "eventlet.monkey_patch()"),
])
def test_a_native_thread_runs_beside_a_busy_green_loop(library: str, patch: str) -> None:
    script = textwrap.dedent(_SCRIPT).format(library=library, patch=patch)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    name, during, ended, took, alive = out
    assert name == library
    assert int(during) >= 10, f"only {during} ticks while the loop was busy"
    assert ended == "True"
    assert alive == "False"
    assert float(took) < 0.5


def test_without_patching_it_is_a_plain_named_thread() -> None:
    import threading

    names: list[str] = []
    thread = NativeThread(lambda t: names.append(threading.current_thread().name), "plain")
    thread.start()
    assert thread.join(5)
    assert patched() is None
    assert names == ["plain"]
    assert not thread.is_alive()
    thread.stop()
    assert thread.wait(10) is True  # stopped: returns at once


@pytest.mark.parametrize(("patch", "setting", "lead"), [
    ("from gevent import monkey; monkey.patch_all()", None, 0.15),
    ("import eventlet; eventlet.monkey_patch()", None, 0.15),
    ("", None, 0.05),
    ("from gevent import monkey; monkey.patch_all()", 0.02, 0.02),
])
def test_the_dispatch_lead_defaults_longer_on_a_green_pool(
    patch: str, setting: float | None, lead: float
) -> None:
    """A green pool's loop delays a dispatched task's arrival while it takes in a burst: its
    node dispatches further ahead, unless the setting says otherwise."""
    script = textwrap.dedent(f"""
        {patch}
        from celery import Celery
        from celery_throttle.integration.config import read_config
        app = Celery("lead", broker="memory://", set_as_current=False)
        app.conf.throttle_redis_url = "redis://127.0.0.1:1/0"  # (never connected)
        if {setting!r} is not None:
            app.conf.throttle_dispatch_lead = {setting!r}
        print(read_config(app).dispatch_lead)
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert float(out[-1]) == lead
