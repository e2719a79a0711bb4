"""Section 9: the soak: faults one after another under steady over-limit traffic.

    python -m benchmarks.soak [--duration 180] [--drain 240] [--visibility 20]
                              [--seeds 1] [--brokers redis,amqp] [--stores aof,none]
                              [--logs DIR] [--quick]

``--quick``: the same regime in about 3 minutes per configuration (72 s of
traffic, faults 12 s apart, a visibility timeout of 8 s, 90 s to drain), for
everyday use; BENCHMARKS.md keeps the full run.

Two prefork nodes of 4 processes run ``benchmarks/soak_app.py`` with
``task_acks_late`` and ``task_reject_on_worker_lost`` (visibility timeout
``--visibility``, 20 s: shorter than the faults' spacing of 30 s, so a
stranded message comes back before the next fault).  For ``--duration`` seconds a
producer sends 1.2 times the capacity of three limits: ``"10/s"`` (priorities
0, 5 and 9 in turn), ``"2/s"`` per tenant over 10 tenants, and
``concurrency=3`` on a task that takes 0.3 s.  Meanwhile, at a sixth, two
sixths ... five sixths of the duration (moved by up to ``duration/36`` by the
seed): a node is SIGKILLed (back 3 s later), the store is SIGKILLed (back
after 5 s), the other node is SIGKILLed (back 3 s later), the broker is
SIGKILLed (back after 4 s), a node is stopped with SIGTERM and started again.
Then up to ``--drain`` seconds for every task to run.  ``SOAK_PREFETCH`` in the
environment sets the nodes' ``worker_prefetch_multiplier`` (Celery's 4 by default).

Each combination of broker (a Redis with AOF, ``appendfsync always``, or a
RabbitMQ node: both keep their messages on disk) and store (its own Redis with
AOF, or one that keeps nothing on disk) runs with the throttle, and each
broker once more without it (``SOAK_THROTTLE=0``, the same tasks and faults:
Celery alone), so a loss or re-run that Celery causes is told apart from ours.

Counted from the records (a start and an end per run, on a Redis never
killed): tasks published, never run (and of those, never received by any
worker: lost by the broker or its transport before Celery saw them, as
kombu's Redis transport does with a message it popped when a node or the
broker dies), started but never ended (every run of it cut off by a kill,
and none again after), run to the end twice (a task killed mid-run and run again, or
whose run ended up to 2 s before its node or the broker was killed, so that
its acknowledgement may have been lost, is acks_late's at-least-once:
counted apart); the most
starts of the rate limit and of one tenant in any 1 s window (every start counted, a
run again after a kill included: it is a call the provider sees), outside the 3 s
after the store came back (a store that lost its data may admit one more
burst); the most runs of the concurrency limit at once; the rate limit used
from its first start to its last; the seats the concurrency limit still holds
after the drain (``throttle status``); per fault, how soon the rate limit
starts again after the fault's end, and its longest gap between two starts
from the fault's start to 10 s after its end (a limit left idle by a fault
shows there, whatever the run's average says).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_throttle.testing import RedisServer, WorkerProcess, max_in_window

ROOT = Path(__file__).resolve().parent.parent
APP = "benchmarks.soak_app"
RATE, TENANT_RATE, TENANTS, SEATS, SEAT_SECONDS = 10, 2, 10, 3, 0.3
DEMAND = 1.2  # the traffic, times each limit's capacity
AOF = ("--appendonly", "yes", "--appendfsync", "always")
RECOVERY_SPAN = 10.0  # seconds after a fault's end in which its longest gap is looked for
PACE_SPAN = 5.0  # seconds per figure of the rate limit's pace over the run
AFTER_STORE_LOSS = 3.0  # seconds after the store is back that the window check leaves out
ACK_LOST = 2.0  # a run that ended this long before a kill may not have been acknowledged
#: The workers' worker_prefetch_multiplier: $SOAK_PREFETCH, else Celery's own (4).
PREFETCH = int(os.environ.get("SOAK_PREFETCH", "4"))
#: (duration, drain, visibility timeout), seconds: the full run and --quick's.
FULL, QUICK = (180.0, 240.0, 20.0), (72.0, 90.0, 8.0)


@dataclass
class Servers:
    """The run's broker and store, killed and started again by the faults."""

    broker_kind: str
    store: RedisServer
    broker: Any = None  # a RedisServer or tests.servers.RabbitMQ

    @property
    def broker_url(self) -> str:
        return f"{self.broker.url}/0" if self.broker_kind == "redis" else str(self.broker.url)

    def kill_broker(self) -> None:
        if self.broker_kind == "redis":
            self.broker.kill()
            return
        proc = self.broker.proc
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def servers(broker_kind: str, store_kind: str) -> Iterator[Servers]:
    """A fresh broker and store for one run, stopped and removed after it."""
    store = RedisServer(None, *(AOF if store_kind == "aof" else ())).start()
    run = Servers(broker_kind, store)
    try:
        if broker_kind == "redis":
            run.broker = RedisServer(None, *AOF).start()
        else:
            sys.path.insert(0, str(ROOT))
            from tests.servers import RabbitMQ

            run.broker = RabbitMQ().start()
        yield run
    finally:
        if run.broker is not None:
            run.broker.stop()
        store.stop()


@dataclass
class Fleet:
    """The two worker nodes; a killed or stopped node is started again under its name."""

    env: dict[str, str]
    logs: list[str] = field(default_factory=list)
    nodes: dict[str, WorkerProcess] = field(default_factory=dict)

    def start(self, name: str) -> None:
        node = WorkerProcess(APP, name, concurrency=4, queues=("celery",), cwd=ROOT,
                             env=self.env)
        self.nodes[name] = node
        node.wait_ready(90)

    def kill(self, name: str) -> None:
        self._retire(name, warm=False)

    def stop(self, name: str) -> None:
        self._retire(name, warm=True)

    def _retire(self, name: str, warm: bool) -> None:
        node = self.nodes.pop(name)
        if warm:
            node.stop(60)
        else:
            node.kill()
        self.logs.append(node.log_text())
        node.log.unlink(missing_ok=True)

    def close(self) -> None:
        for node in list(self.nodes.values()):
            node.terminate()
        for name in list(self.nodes):
            self.stop(name)


class Producer(threading.Thread):
    """Sends DEMAND times each limit's capacity until stopped; a publish the broker refuses
    (it is down) is tried again, so every id in ``sent`` was accepted by the broker."""

    def __init__(self, app_module: Any) -> None:
        super().__init__(daemon=True)
        self.app_module = app_module
        self.sent: dict[str, str] = {}  # task id -> kind
        self.halt = threading.Event()

    def send(self, kind: str, n: int) -> str:
        """Publish task ``n`` of ``kind``; its id."""
        mod = self.app_module
        if kind == "rate":
            return str(mod.rated.apply_async((n,), priority=(0, 5, 9)[n % 3]).id)
        if kind == "tenant":
            return str(mod.per_tenant.apply_async((n, f"t{n % TENANTS}")).id)
        return str(mod.seats.apply_async((n,)).id)

    def run(self) -> None:
        per_second = DEMAND * (RATE + TENANT_RATE * TENANTS + SEATS / SEAT_SECONDS)
        every = 1.0 / per_second
        kinds = ["rate"] * 12 + ["tenant"] * 24 + ["seats"] * 12  # DEMAND x capacity per s
        random.Random(7).shuffle(kinds)
        i, start = 0, time.monotonic()
        while not self.halt.is_set():
            kind = kinds[i % len(kinds)]
            for _ in range(600):  # a broker down for minutes: give up on this one
                if self.halt.is_set():
                    return
                try:
                    self.sent[self.send(kind, i)] = kind
                    break
                except Exception:  # the broker is down: try again
                    time.sleep(0.2)
            i += 1
            self.halt.wait(max(0.0, start + i * every - time.monotonic()))


def _faults(duration: float, seed: int) -> list[tuple[float, str]]:
    """The fault schedule: (seconds after the first send, what)."""
    rng = random.Random(seed)
    what = ["kill node a", "kill store", "kill node b", "kill broker", "stop node a"]
    return [((k + 1) * duration / 6 + rng.uniform(-1, 1) * duration / 36, w)
            for k, w in enumerate(what)]


def _run(broker_kind: str, store_kind: str, throttle: bool, seed: int, duration: float,
         drain: float, visibility: float, records_url: str, logs: Path | None
         ) -> dict[str, Any]:
    records = redis.Redis.from_url(f"{records_url}/3")
    records.flushdb()
    with servers(broker_kind, store_kind) as run:
        env = {"SOAK_BROKER": run.broker_url, "SOAK_STORE": f"{run.store.url}/0",
               "SOAK_RECORDS": records_url, "SOAK_THROTTLE": "1" if throttle else "0",
               "SOAK_VISIBILITY": f"{visibility:g}", "SOAK_PREFETCH": str(PREFETCH),
               "PYTHONPATH": str(ROOT)}
        os.environ.update(env)
        sys.modules.pop(APP, None)
        mod = __import__(APP, fromlist=["app"])
        fleet = Fleet(env)
        producer = Producer(mod)
        done: list[tuple[float, str]] = []
        kills: list[tuple[float, str]] = []  # (when, the node killed; "": the broker)
        cut: list[tuple[float, str]] = []  # (when, the node killed or stopped)
        windows: list[tuple[str, float, float]] = []  # (fault, its start, its end)
        store_back = 0.0
        try:
            fleet.start("a")
            fleet.start("b")
            t0 = time.time()
            producer.start()
            for at, what in _faults(duration, seed):
                time.sleep(max(0.0, t0 + at - time.time()))
                done.append((time.time() - t0, what))
                if what.startswith(("kill node", "kill broker")):
                    kills.append((time.time(), what[-1] if "node" in what else ""))
                if what.startswith(("kill node", "stop node")):
                    cut.append((time.time(), what[-1]))
                began = time.time()
                if what.startswith("kill node"):
                    name = what[-1]
                    fleet.kill(name)
                    # (The other node is up: the limit should not wait for this one.)
                    windows.append((what, began, began))
                    time.sleep(3)
                    fleet.start(name)
                elif what == "kill store":
                    run.store.kill()
                    time.sleep(5)
                    run.store.start()
                    store_back = time.time()
                    windows.append((what, began, store_back))
                elif what == "kill broker":
                    run.kill_broker()
                    time.sleep(4)
                    run.broker.start()
                    windows.append((what, began, time.time()))
                else:
                    windows.append((what, began, began))
                    fleet.stop("a")
                    fleet.start("a")
            time.sleep(max(0.0, t0 + duration - time.time()))
            producer.halt.set()
            producer.join(150)
            sent = dict(producer.sent)
            deadline = time.monotonic() + drain
            while time.monotonic() < deadline:
                ended = {json.loads(r)["id"] for r in records.lrange("soak:end", 0, -1)}
                if all(i in ended for i in sent):
                    break
                time.sleep(1.0)
            held = _seats_held(env) if throttle else None
            left = _left_in_broker(run.broker_url) if broker_kind == "amqp" else ""
        finally:
            producer.halt.set()
            fleet.close()
            mod.app.pool.force_close_all()
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            name = f"{broker_kind}-{store_kind}-{'ours' if throttle else 'celery'}-{seed}.log"
            (logs / name).write_text("\n".join(fleet.logs))
            (logs / name).with_suffix(".records").write_text("\n".join(
                json.dumps(json.loads(r)) for r in records.lrange("soak:start", 0, -1)
                + records.lrange("soak:end", 0, -1)))
    seen = "\n".join(fleet.logs)
    result = _judge(sent, records, t0, store_back if store_kind == "none" else 0.0,
                    lambda task_id: f"[{task_id}] received" in seen, kills, windows, cut)
    result.update(broker=broker_kind, store=store_kind if throttle else "-",
                  throttle=throttle, seed=seed, held=held, left=left,
                  faults=", ".join(f"{w} {t:.0f}" for t, w in done))
    return result


def _left_in_broker(url: str) -> str:
    """Messages left in RabbitMQ's queues (the delay ladder's and the task queue's and its
    lane) after the drain: where tasks that never ran were, if not lost.  Not counted: a
    message a ladder's rung could not hand on, which RabbitMQ keeps out of every count and
    tries again after its dead_letter_worker_publisher_confirm_timeout (180 s)."""
    from kombu import Connection

    from celery_throttle.room.dispatcher import lane_of
    from celery_throttle.room.ladder import RUNGS, rung_name

    names = [rung_name(k) for k in range(RUNGS)] + ["celery", lane_of("celery")]
    found = []
    with contextlib.suppress(Exception), Connection(url) as conn:
        for name in names:
            channel: Any = conn.channel()  # (a queue never declared closes its channel)
            with contextlib.suppress(Exception):
                count = channel.queue_declare(name, passive=True).message_count
                if count:
                    found.append(f"{name} {count}")
    return ", ".join(found) or "none"


def _seats_held(env: dict[str, str]) -> int | None:
    """The seats the concurrency limit holds now, as ``throttle status --json`` says."""
    out = subprocess.run([sys.executable, "-m", "celery", "-A", APP, "throttle", "status",
                          "--json", "soak-seats"], env={**os.environ, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    with contextlib.suppress(ValueError, KeyError, IndexError):
        return int(json.loads(out.stdout)["limits"][0]["held"])
    return None


def _judge(sent: dict[str, str], records: redis.Redis, t0: float, store_back: float,
           received: Callable[[str], bool], kills: list[tuple[float, str]],
           windows: list[tuple[str, float, float]],
           cut: list[tuple[float, str]]) -> dict[str, Any]:
    starts = [json.loads(r) for r in records.lrange("soak:start", 0, -1)]
    ends = [json.loads(r) for r in records.lrange("soak:end", 0, -1)]
    started, ended = Counter(s["id"] for s in starts), Counter(e["id"] for e in ends)
    first_end: dict[str, dict[str, Any]] = {}
    for e in sorted(ends, key=lambda e: float(e["t"])):
        first_end.setdefault(e["id"], e)

    def ack_lost(task_id: str) -> bool:
        """Its first run ended just before its node or the broker was killed."""
        e = first_end[task_id]
        node = str(e["node"]).split("@")[0]
        return any(who in ("", node) and e["t"] <= at <= e["t"] + ACK_LOST
                   for at, who in kills)

    out: dict[str, Any] = {}
    for group in ("rate", "tenant", "seats"):
        ids = [i for i, kind in sent.items() if kind == group]
        never = [i for i in ids if not started[i]]
        out[group] = {"published": len(ids), "never": len(never),
                      "unreceived": sum(1 for i in never if not received(i)),
                      "unfinished": sum(1 for i in ids if started[i] and not ended[i]),
                      "twice": sum(1 for i in ids if ended[i] > 1 and not ack_lost(i)),
                      "reruns": sum(1 for i in ids if started[i] > 1 and (
                          ended[i] <= 1 or ack_lost(i)))}

    def counted(t: float) -> bool:
        return not (store_back and store_back <= t < store_back + AFTER_STORE_LOSS)

    rated = sorted(s["t"] for s in starts if s["kind"] == "rate")
    out["rate"]["window"] = max_in_window([t for t in rated if counted(t)], 1.0)
    out["rate"]["used"] = ((len(rated) - 1) / (rated[-1] - rated[0]) / RATE
                           if len(rated) > 1 else 0.0)
    out["recovery"] = [(what, *_recovery(rated, began, end)) for what, began, end in windows]
    out["rate"]["pace"] = _pace(rated, t0)
    by_tenant: defaultdict[str, list[float]] = defaultdict(list)
    for s in starts:
        if s["kind"].startswith("tenant:") and counted(s["t"]):
            by_tenant[s["kind"]].append(s["t"])
    out["tenant"]["window"] = max((max_in_window(ts, 1.0) for ts in by_tenant.values()),
                                  default=0)
    out["seats"]["in_flight"] = _most_at_once(starts, ends, cut)
    out["last"] = max((e["t"] for e in ends), default=t0) - t0
    return out


def _recovery(rated: list[float], began: float, end: float) -> tuple[float, float]:
    """After one fault: seconds from its end to the rate limit's next start, and the longest
    gap between two of its starts from the fault's start to RECOVERY_SPAN after its end
    (a limit in full use starts every 1/RATE s; the span ends with the run's last start)."""
    after = next((t for t in rated if t >= end), None)
    if after is None:
        return math.inf, math.inf
    stop = min(end + RECOVERY_SPAN, rated[-1])
    span = [began, *(t for t in rated if began <= t <= stop), stop]
    return after - end, max(b - a for a, b in itertools.pairwise(span))


def _pace(rated: list[float], t0: float) -> str:
    """The rate limit's starts per second in each PACE_SPAN seconds from the first publish to
    its last start: where a run loses the limit (a fault, a backlog's recovery)."""
    spans = Counter(int((t - t0) // PACE_SPAN) for t in rated if t >= t0)
    return " ".join(f"{spans[k] / PACE_SPAN:.1f}" for k in range(max(spans, default=-1) + 1))


def _recovery_line(r: dict[str, Any]) -> str:
    return "; ".join(f"{what}: next start {next_start:.2f} s, longest gap {gap:.2f} s"
                     for what, next_start, gap in r["recovery"])


def _most_at_once(starts: list[dict[str, Any]], ends: list[dict[str, Any]],
                  cut: list[tuple[float, str]]) -> int:
    """The most runs of the concurrency limit at once.  A run with no end was cut off
    (its node killed, or stopped with its pool processes): it ended when its node was
    cut, at most SEAT_SECONDS after its start."""
    end_of: defaultdict[tuple[str, int], list[float]] = defaultdict(list)
    for e in ends:
        if e["kind"] == "seats":
            end_of[(e["id"], e["pid"])].append(e["t"])
    events: list[tuple[float, int]] = []
    for s in starts:
        if s["kind"] != "seats":
            continue
        later = [t for t in end_of[(s["id"], s["pid"])] if t >= s["t"]]
        node = str(s["node"]).split("@")[0]
        cut_at = [at for at, who in cut if who == node and at >= s["t"]]
        died = min([s["t"] + SEAT_SECONDS, *cut_at])
        events += [(s["t"], 1), (min(later, default=died), -1)]
    most = now = 0
    for _, step in sorted(events):  # an end before a start at the same moment
        now += step
        most = max(most, now)
    return most


def _row(r: dict[str, Any]) -> str:
    def group(g: str) -> str:
        x = r[g]
        never = f"{x['never']}" + (f" ({x['unreceived']} unreceived)" if x["unreceived"]
                                   else "")
        never += f" ({x['unfinished']} started, never ended)" if x["unfinished"] else ""
        return f"{x['published']} / {never} / {x['twice']} / {x['reruns']}"

    who = "ours" if r["throttle"] else "Celery alone"
    held = "-" if r["held"] is None else str(r["held"])
    used = f"{r['rate']['used']:.2f}" if r["throttle"] else "-"  # (no limit: nothing to use)
    return (f"| {r['broker']} | {r['store']} | {who} | {r['seed']} | {group('rate')} "
            f"| {group('tenant')} | {group('seats')} | {r['rate']['window']} "
            f"| {r['tenant']['window']} | {r['seats']['in_flight']} | {held} "
            f"| {used} | {r['last']:.0f} |")


def main(argv: list[str] | None = None) -> None:
    """Print the section's markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=None, help="180 s (--quick: 72)")
    parser.add_argument("--drain", type=float, default=None, help="240 s (--quick: 90)")
    parser.add_argument("--visibility", type=float, default=None, help="20 s (--quick: 8)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--brokers", default="redis,amqp")
    parser.add_argument("--stores", default="aof,none")
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="about 3 minutes per configuration, the same regime")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    duration, drain, visibility = (
        given if given is not None else default for given, default in
        zip((args.duration, args.drain, args.visibility), preset, strict=True))
    # Faults closer together than the visibility timeout would overlap: a
    # stranded message still out when the next fault comes.
    if duration / 6 <= visibility:
        parser.error(f"--duration {duration:g}: its faults, {duration / 6:g} s apart, must be "
                     f"further apart than the visibility timeout ({visibility:g} s)")
    # A SIGTERM unwinds like an error: every server and worker started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    brokers = [b for b in args.brokers.split(",") if b]
    if "amqp" in brokers and not (Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists()
                                  or shutil.which("rabbitmq-server")):
        print("(rabbitmq-server is not installed: the RabbitMQ rows are left out)\n")
        brokers.remove("amqp")
    plan = [(b, s, True) for b in brokers for s in args.stores.split(",") if s]
    plan += [(b, "aof", False) for b in brokers]
    print(f"Over-limit traffic ({DEMAND}x each limit) for {duration:.0f} s under five "
          f"faults, then up to {drain:.0f} s to drain; 2 nodes x 4 prefork processes, "
          f"acks_late, visibility timeout {visibility:g} s, prefetch multiplier {PREFETCH}.  "
          "Per limit: published / never ran "
          "/ ran to the end twice / run again after a kill (mid-run, or before its ack: "
          "acks_late's own).  Unreceived: a task that never ran and that no worker logged "
          "as received (the broker lost it before any worker saw it).  Started, never "
          "ended: a task whose runs were all cut off (a kill) and that never ran again "
          "(with acks_late it should have).\n")
    print("| broker | store | | seed | 10/s | 2/s per tenant | concurrency 3 | most in 1 s "
          "(bound 11) | most per tenant in 1 s (bound 3) | most at once (3 seats) "
          "| seats held after | 10/s used | last end, s |")
    print("|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
    recovery: list[str] = []
    with RedisServer() as records:
        for seed in range(1, args.seeds + 1):
            for broker_kind, store_kind, throttle in plan:
                r = _run(broker_kind, store_kind, throttle, seed, duration, drain, visibility,
                         records.url, args.logs)
                print(_row(r), flush=True)
                print(f"<!-- faults: {r['faults']} -->", flush=True)
                if r["throttle"]:
                    print(f"<!-- 10/s starts per second, each {PACE_SPAN:g} s from the first "
                          f"publish: {r['rate']['pace']} -->", flush=True)
                if r["left"]:
                    print(f"<!-- left in the broker after the drain: {r['left']} -->", flush=True)
                recovery.append(f"- {r['broker']}, {r['store']}, "
                                f"{'ours' if r['throttle'] else 'Celery alone'}, seed "
                                f"{r['seed']}: {_recovery_line(r)}")
    print("\nRecovery per fault (from its end: a node's kill and the warm stop end at once, "
          "the other node being up; the store and the broker when started again): the rate "
          "limit's next start, and its longest gap between two starts from the fault's "
          f"start to {RECOVERY_SPAN:g} s after its end (in full use: {1 / RATE:g} s).\n")
    print("\n".join(recovery))


if __name__ == "__main__":
    main()
