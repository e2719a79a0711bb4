"""The hot path of both gates: a plain decision as a hand-packed EVALSHA on a kept connection.

A plain decision (server clock, no claim, no holder) sends the same bytes
every time for the same limits, horizon and grace.  Packed once and sent on
a connection the gate keeps between calls, it skips redis-py's per-call
argument packing, its command machinery and its pool's checkout (a lock,
observability counters and a readiness poll per call): most of a
decision's client-side cost (BENCHMARKS.md section 2 compares the two
paths with a PING).

Everything else of that path lives here, once for both gates:

* NOSCRIPT (the server restarted or ran SCRIPT FLUSH) is answered on the
  same connection: load the script and ask again; the NOSCRIPT reply
  charged nothing.
* A connection whose call broke or was cancelled mid-reply is disconnected
  and handed back to the pool, never reused: its reply may still arrive.
* At most :data:`IDLE_CONNECTIONS` are kept; the rest go back to the pool,
  which the gate's other commands need too.
* A forked child (prefork pools) drops the parent's kept connections.

A connection error returns None: the gate then takes redis-py's path, which
reconnects (and raises if it cannot).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

__all__ = ["IDLE_CONNECTIONS", "AsyncPackedPath", "Call", "PackedPath", "Plain",
           "checkout_args"]

#: Connections a gate keeps between packed decisions, at most.
IDLE_CONNECTIONS = 8
# Packed commands kept per gate (one per limits/horizon/grace combination):
# bounded, since per-key limits may be many.
_MAX_PACKED = 4096

Call = tuple[list[bytes], list[bytes]]  # (KEYS, ARGV) of one gate command
# A plain decision: its cache key, and its packed command or the call to pack.
Plain = tuple[tuple[Any, ...], "list[bytes] | Call"]


def checkout_args(get_connection: Callable[..., Any]) -> tuple[str, ...]:
    """What a pool's ``get_connection`` needs: redis-py < 5.1 requires a command name
    (unused by a plain pool), newer ones deprecate passing one."""
    param = inspect.signature(get_connection).parameters.get("command_name")
    return ("EVALSHA",) if param is not None and param.default is param.empty else ()


class _Packer:
    """The packed commands of one gate, and the connections it keeps."""

    def __init__(self, pool: Any, script: str, sha: str) -> None:
        self.pool = pool
        self.script = script
        self.sha = sha
        self.idle: list[Any] = []
        self.checkout = checkout_args(pool.get_connection)
        self._cache: dict[tuple[Any, ...], list[bytes]] = {}

    def cached(self, key: tuple[Any, ...]) -> list[bytes] | None:
        """The packed command of ``key``, if packed before (``TypeError``: unhashable)."""
        return self._cache.get(key)

    def packed(self, conn: Any, plain: Plain) -> list[bytes]:
        """The command of ``plain``: cached, or packed now by ``conn`` and kept."""
        key, ready = plain
        if not isinstance(ready, tuple):
            return ready
        keys, args = ready
        command: list[bytes] = conn.pack_command("EVALSHA", self.sha, len(keys), *keys, *args)
        if len(self._cache) >= _MAX_PACKED:
            self._cache.clear()
        self._cache[key] = command
        return command

    def keep(self, conn: Any, healthy: bool) -> bool:
        """Keep ``conn`` for the next decision?  Else the caller hands it back."""
        if healthy and len(self.idle) < IDLE_CONNECTIONS:
            self.idle.append(conn)
            return True
        return False


class PackedPath(_Packer):
    """The packed path of a :class:`~celery_throttle.Gate` on a pooled ``redis.Redis``."""

    @staticmethod
    def takes(client: object) -> bool:
        """A pooled client of its own: not a pipeline, a single connection or a cluster."""
        return (isinstance(client, redis.Redis)
                and not isinstance(client, redis.client.Pipeline)
                and getattr(client, "connection", None) is None)

    def __init__(self, client: redis.Redis, script: str, sha: str) -> None:
        super().__init__(client.connection_pool, script, sha)
        self._pid = os.getpid()

    def send(self, plain: Plain) -> Any:
        """The reply to ``plain``; None: take the full path."""
        conn = self._connection()
        healthy = False
        try:
            command = self.packed(conn, plain)
            conn.send_packed_command(command)
            try:
                reply = conn.read_response()
            except redis.exceptions.NoScriptError:
                conn.send_command("SCRIPT", "LOAD", self.script)
                conn.read_response()
                conn.send_packed_command(command)
                reply = conn.read_response()
            healthy = True
            return reply
        except redis.exceptions.NoScriptError:
            healthy = True  # a whole reply was read: the connection is fine
            return None
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        finally:
            if not self.keep(conn, healthy):
                if not healthy:  # a reply may still be on its way: never hand this socket on
                    conn.disconnect()
                self.pool.release(conn)

    def close(self) -> None:
        """Hand the kept connections back to the pool."""
        while self.idle:
            self.pool.release(self.idle.pop())

    def _connection(self) -> Any:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self.idle, self._pid = [], os.getpid()
        try:
            return self.idle.pop()
        except IndexError:
            return self.pool.get_connection(*self.checkout)


class AsyncPackedPath(_Packer):
    """:class:`PackedPath` on a pooled ``redis.asyncio.Redis``."""

    @staticmethod
    def takes(client: object) -> bool:
        """A pooled client (not a single-connection one, not a cluster)."""
        return isinstance(client, aioredis.Redis) and getattr(client, "connection", None) is None

    def __init__(self, client: aioredis.Redis, script: str, sha: str) -> None:
        super().__init__(client.connection_pool, script, sha)

    async def send(self, plain: Plain) -> Any:
        """The reply to ``plain``; None: take the full path."""
        try:
            conn: Any = self.idle.pop()
        except IndexError:
            conn = await self.pool.get_connection(*self.checkout)
        healthy = False
        try:
            command = self.packed(conn, plain)
            await conn.send_packed_command(command)
            try:
                reply = await conn.read_response()
            except redis.exceptions.NoScriptError:
                await conn.send_command("SCRIPT", "LOAD", self.script)
                await conn.read_response()
                await conn.send_packed_command(command)
                reply = await conn.read_response()
            healthy = True
            return reply
        except redis.exceptions.NoScriptError:
            healthy = True
            return None
        except (aioredis.ConnectionError, aioredis.TimeoutError):
            return None
        finally:
            if not self.keep(conn, healthy):
                if not healthy:  # cancelled or broken mid-call: a reply may still come
                    await conn.disconnect(nowait=True)
                await self.pool.release(conn)

    async def close(self) -> None:
        """Hand the kept connections back to the pool."""
        while self.idle:
            await self.pool.release(self.idle.pop())
