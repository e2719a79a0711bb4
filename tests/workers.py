"""Test glue: the test app's workers, its start records, and a publish recorder."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import WorkerProcess, free_port, max_in_window, workers

from . import databases

ROOT = Path(__file__).resolve().parent.parent


#: Settings of the countdown path (the waiting room off).
COUNTDOWNS: dict[str, object] = {"throttle_waiting_room": False}


def short_visibility(seconds: float) -> dict[str, object]:
    """A short broker visibility timeout, swept every second (kombu's default sweep is every
    100 s), so that stranded messages come back within a test."""
    return {"broker_transport_options": {"visibility_timeout": seconds,
                                         "unacked_restore_interval": 1,
                                         "unacked_restore_throttle": 1}}


#: acks_late, and a message of a worker that died is given back (the crash tests).
ACKS_LATE: dict[str, object] = {"task_acks_late": True, "task_reject_on_worker_lost": True}

#: Accept pickle (Celery refuses to start as root with it unless C_FORCE_ROOT
#: is set; CI runs as root) as well as msgpack.
PICKLE: dict[str, object] = {"accept_content": ["json", "pickle", "msgpack"]}


def app_env(redis_base: str, conf: Mapping[str, object] | None = None,
            fault: str | None = None) -> dict[str, str]:
    """The environment of a tests.celery_app process: servers, settings, an injected fault."""
    env = {"CT_REDIS": redis_base, "PYTHONPATH": str(ROOT), "CT_CONF": json.dumps(dict(conf or {}))}
    if fault is not None:
        env["CT_FAULT"] = fault
    if "accept_content" in (conf or {}):
        env["C_FORCE_ROOT"] = "1"
    return env


def throttle_cli(args: list[str], redis_base: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.celery_app throttle ARGS`` against the test app's store."""
    env = {**os.environ, **app_env(redis_base)}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.celery_app", "throttle",
                           *args], env=env, capture_output=True, text=True, timeout=60,
                          cwd=ROOT, check=False)


@contextlib.contextmanager
def app_command(args: list[str], redis_base: str, env: Mapping[str, str], *, what: str,
                ready: Callable[[str], object]) -> Iterator[str]:
    """``celery -A tests.celery_app ARGS --port P`` (a web server of the test app) on a free
    loopback port: its URL once ``ready(url)`` stops raising (30 s at most); stopped after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.celery_app", *args,
                             f"--port={port}"], env={**os.environ, **app_env(redis_base), **env},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ready(url)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"{what} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def worker_nodes(redis_base: str, names: tuple[str, ...] = ("w1", "w2"), *,
                 pool: str = "prefork", concurrency: int = 4,
                 conf: Mapping[str, object] | None = None, fault: str | None = None,
                 env: dict[str, str] | None = None,
                 queues: tuple[str, ...] = ("celery", "ext", "bursty"),
                 ) -> Iterator[list[WorkerProcess]]:
    """Worker nodes of tests.celery_app (on every test queue by default), against ``redis_base``.

    ``conf``: settings of the app (``CT_CONF``); ``fault``: a point of
    ``celery_throttle.faults`` where the node dies (``CT_FAULT``); ``env``:
    anything else the process needs.
    """
    with workers("tests.celery_app", names, pool=pool, concurrency=concurrency,
                 queues=queues, cwd=ROOT,
                 env={**app_env(redis_base, conf, fault), **(env or {})}) as nodes:
        yield nodes


def logs(nodes: list[WorkerProcess]) -> str:
    """All nodes' logs, concatenated."""
    return "\n".join(n.log_text() for n in nodes)


def read_records(client: redis.Redis, *, expect: int, timeout: float) -> list[dict[str, Any]]:
    """Wait (bounded) until ``expect`` start records exist, then return them sorted by time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and client.llen("records") < expect:
        time.sleep(0.1)
    rows = [json.loads(r) for r in client.lrange("records", 0, -1)]
    return sorted(rows, key=lambda r: r["t"])


def until_done_or_quiet(client: redis.Redis, done: Callable[[], bool],
                        after: Callable[[], float | None], *, quiet: float,
                        timeout: float) -> None:
    """For runs where some starts never come (a node killed on purpose): wait (bounded)
    until ``done()``, or until it is past ``after()`` (wall clock; None: not yet known) and
    no start was recorded for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline and not done():
        count = client.llen("records")
        if count != seen:
            seen, since = count, time.monotonic()
        start = after()
        if start is not None and time.time() > start and time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)


def read_records_until_quiet(client: redis.Redis, *, expect: int, after: float, quiet: float,
                             timeout: float) -> list[dict[str, Any]]:
    """:func:`read_records` when some starts may never come (:func:`until_done_or_quiet`)."""
    until_done_or_quiet(client, lambda: client.llen("records") >= expect, lambda: after,
                        quiet=quiet, timeout=timeout)
    return read_records(client, expect=0, timeout=0)


def waiting(store: redis.Redis) -> int:
    """How many tasks wait in the limits' lines or the waiting room's timer: every stored
    message but those being dispatched."""
    return (int(store.hlen("{throttle}:room:messages"))
            - int(store.zcard("{throttle}:room:claimed")))


def wait_in_line(redis_base: str, count: int, timeout: float, *, store: str | None = None
                 ) -> None:
    """Wait until ``count`` tasks of tests.celery_app wait in line (bounded): the store's own
    count, not a guess by time.  ``store``: the throttle store's URL when it is not the
    test app's own (``redis_base``, database 11)."""
    client = redis.Redis.from_url(store or f"{redis_base}/{databases.STORE}")
    deadline = time.monotonic() + timeout
    most = 0
    try:
        while time.monotonic() < deadline:
            now = waiting(client)
            if now >= count:
                return
            most = max(most, now)
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"fewer than {count} tasks got in line within {timeout}s "
                         f"(at most {most})")


def no_start_beyond(client: redis.Redis, count: int, seconds: float) -> list[dict[str, Any]]:
    """Watch the start records for ``seconds`` (a duplicate's or a held task's chance to
    start) and fail at once if there are ever more than ``count``; return them, by time.

    An absence can only be shown by waiting: this waits the whole window when all is
    well and no longer than the first extra start when it is not."""
    deadline = time.monotonic() + seconds
    while True:
        seen = client.llen("records")
        assert seen <= count, f"{seen} starts recorded, at most {count} expected"
        if time.monotonic() >= deadline:
            return read_records(client, expect=0, timeout=0)
        time.sleep(0.05)


def wait_results(results: list[Any], timeout: float) -> list[str]:
    """Poll (bounded) until every AsyncResult is ready; return their states."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(r.ready() for r in results):
        time.sleep(0.2)
    return [r.state for r in results]


def check_window_bound(
    times: list[float], rate: float, burst: int, period: float
) -> dict[float, int]:
    """Assert no window from a quarter period to five periods exceeds B-1+ceil(w*rate)+1."""
    worst = {}
    for w in (period / 4, period / 2, period, 2 * period, 5 * period):
        allowed = burst - 1 + math.ceil(w * rate - 1e-9) + 1  # +1: scheduling jitter
        seen = max_in_window(times, w)
        worst[w] = seen
        assert seen <= allowed, f"{seen} starts in a {w}s window, bound {allowed}"
    return worst


class PublishRecorder:
    """Stands in for a signature in unit tests: records the options it was made with.

    The throttle captures what a signature publishes (``room.envelope.capture``)
    and sends that: this one publishes a small message, which the test app's
    broker keeps in a list of its own (``recorded``)."""

    type = None  # (no task: the capture reads ignore_result from the options)

    def __init__(self, sink: list[dict[str, Any]], options: dict[str, Any]) -> None:
        self.sink, self.options = sink, options

    def apply_async(self, producer: Any = None, **_: Any) -> None:
        self.sink.append(self.options)
        if producer is not None:
            producer.publish({"recorded": True}, exchange="", routing_key="recorded",
                             serializer="json", headers={"id": "recorded", "task": "recorded"})
