"""From a store URL to a Redis client: one server, Sentinel, or Cluster.

The URL forms, and what each makes (sync, or ``redis.asyncio`` with
:func:`connect_async`):

* ``redis://``, ``rediss://``, ``unix://``: one server, ``Redis.from_url``.
* ``sentinel://host:26379;sentinel://host2:26379``: the form Celery's own
  broker URL takes (kombu's).  The client follows the master that the
  sentinels name ``master_name`` (``throttle_sentinel_master``, by default the
  broker's ``broker_transport_options["master_name"]``), through redis-py's
  ``Sentinel``, so a failover needs no restart.  A password, user name and
  database in the first URL are the master's (as kombu reads them); the
  sentinels' own are ``sentinel_kwargs``.
* ``redis+cluster://host:7000`` (``rediss+cluster://`` with TLS; several
  start nodes joined by ``;``): a Redis Cluster through redis-py's
  ``RedisCluster``, which follows ``MOVED`` and ``ASK`` after a resharding.
  Every key of one prefix carries the prefix as its hash tag (``keys.py``),
  so one decision's keys hash alike: one shard carries a prefix.

A query string (``?ssl_ca_certs=/etc/ca.pem&socket_timeout=2``) holds
connection options, read as redis-py reads them for ``redis://``
(:data:`QUERY_OPTIONS`).  On a Sentinel or Cluster URL any part may carry
them; a name that is not a connection option, or one part contradicting
another, is a ``ValueError`` naming it, never an option silently dropped.
TLS options need TLS: ``rediss+cluster://``, or ``ssl=true`` on a
``sentinel://`` URL (the master's connections).

Store errors: both gates raise redis-py's ``RedisError`` family, whatever
the store.  redis-py's cluster clients report an unreachable cluster as
``RedisClusterException``, which is not one: here it becomes
``redis.ConnectionError``, on the sync and the asyncio client alike.

Everything here is a lower layer than the gates: it knows URLs and redis-py,
nothing of limits.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis._parsers.encoders import Encoder
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.connection import parse_url as _untyped_parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

__all__ = ["QUERY_OPTIONS", "SCHEMES", "AsyncCluster", "AsyncSentinelMaster", "LazyCluster",
           "SentinelMaster", "check_url", "connect", "connect_async", "kind_of", "query_options"]

#: The accepted schemes, by the kind of store each reaches.
SCHEMES: dict[str, str] = {
    "redis": "server", "rediss": "server", "unix": "server",
    "sentinel": "sentinel",
    "redis+cluster": "cluster", "rediss+cluster": "cluster",
}

#: The connection options a Sentinel or Cluster URL's query may set: those redis-py
#: reads from a ``redis://`` query, and its TLS and client-name options.
QUERY_OPTIONS = frozenset({
    *URL_QUERY_ARGUMENT_PARSERS, "ssl", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data",
    "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs", "ssl_ciphers",
    "client_name",
}) - {"db", "max_connections", "timeout"}

PARSE_URL = cast(Callable[[str], dict[str, Any]], _untyped_parse_url)  # typed here

#: Seconds a sentinel query may take: a dead sentinel is skipped, not waited for.
SENTINEL_TIMEOUT = 0.5


def kind_of(url: object) -> str:
    """``"server"``, ``"sentinel"`` or ``"cluster"``; ``ValueError`` naming the scheme."""
    scheme = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else None
    if scheme not in SCHEMES:
        shown = scheme if scheme is not None else (
            url if not isinstance(url, str) else "no scheme")
        raise ValueError(
            f"a redis://, rediss://, unix://, sentinel:// or redis+cluster:// URL is needed "
            f"(the scheme is {shown!r})")
    return SCHEMES[scheme]


def check_url(url: object, master_name: object = None) -> str:
    """The kind of store ``url`` reaches (:func:`kind_of`), if a client can be made of it
    (with ``master_name`` for Sentinel); else ``ValueError`` saying what is missing."""
    kind = kind_of(url)
    assert isinstance(url, str)
    for part in _parts(url):
        if kind != "server" and not part.hostname:
            raise ValueError(f"a {kind} URL names host:port in each ';'-separated part")
        if kind == "cluster" and part.path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has only database 0 (the URL names "
                             f"{part.path.strip('/')!r})")
    if kind != "server":
        query_options(url)
    if kind == "sentinel" and (not isinstance(master_name, str) or not master_name):
        raise ValueError(f"a sentinel:// URL needs the master's name (got {master_name!r}): "
                         "set throttle_sentinel_master, or broker_transport_options"
                         "['master_name'] when the store is the broker")
    return kind


def query_options(url: str) -> dict[str, Any]:
    """The connection options in the query of a Sentinel or Cluster URL (of all its parts).

    Each is parsed as redis-py parses a ``redis://`` query; ``ValueError``
    names an option that is not in :data:`QUERY_OPTIONS`, a value that does
    not parse, two parts that disagree, or a TLS option without TLS.
    """
    found: dict[str, Any] = {}
    for part in _parts(url):
        names = [name for name, _ in parse_qsl(part.query, keep_blank_values=True)]
        unknown = sorted(set(names) - QUERY_OPTIONS)
        if unknown:
            raise ValueError(f"the store URL's query has {unknown[0]!r}, which is not a "
                             f"connection option (known: {', '.join(sorted(QUERY_OPTIONS))})")
        if not names:
            continue
        parsed: dict[str, Any] = PARSE_URL(f"redis://h/?{part.query}")
        parsed.pop("host", None)
        if "ssl" in parsed:  # a flag redis-py's URL parser does not know
            parsed["ssl"] = str(parsed["ssl"]).lower() in ("1", "true", "yes", "y", "on")
        for name, value in parsed.items():
            if found.setdefault(name, value) != value:
                raise ValueError(f"the store URL's parts disagree on {name!r}")
    tls = urlsplit(url).scheme.startswith("rediss") or found.get("ssl") is True
    tls_only = sorted(n for n in found if n.startswith("ssl_"))
    if tls_only and not tls:
        raise ValueError(f"the store URL sets {tls_only[0]!r} but not TLS: use "
                         "rediss+cluster://, or ssl=true on a sentinel:// URL")
    return found


def connect(url: str, *, master_name: str | None = None,
            sentinel_kwargs: Mapping[str, Any] | None = None,
            **options: Any) -> redis.Redis | RedisCluster:
    """A client for ``url``; ``options`` (timeouts, ...) go to every connection it makes."""
    return cast(redis.Redis | RedisCluster,
                _client(_SYNC, url, master_name, sentinel_kwargs, options))


def connect_async(url: str, *, master_name: str | None = None,
                  sentinel_kwargs: Mapping[str, Any] | None = None,
                  **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """:func:`connect` on ``redis.asyncio``."""
    return cast(aioredis.Redis | AsyncRedisCluster,
                _client(_ASYNC, url, master_name, sentinel_kwargs, options))


@dataclass(frozen=True, slots=True)
class _Makers:
    """How one flavour of redis-py (sync or asyncio) makes each kind of client."""

    server: Callable[..., Any]  # from a URL
    cluster: Callable[..., Any]  # from startup_nodes=, ssl= and connection options
    node: Callable[..., Any]  # a cluster start node, from (host, port)
    sentinel: Callable[..., Any]  # a Sentinel, from [(host, port)] and options
    master: type  # the class of the master's client


def _client(makers: _Makers, url: str, master_name: str | None,
            sentinel_kwargs: Mapping[str, Any] | None, options: dict[str, Any]) -> Any:
    kind = check_url(url, master_name)
    if kind == "server":
        return makers.server(url, **options)
    first, nodes, auth = _split(url)
    # Options given in the call win over the URL's, as with redis-py's from_url.
    options = {**query_options(url), **options}
    if kind == "cluster":
        # (Cluster clients run their own health checks.)
        cluster_opts = {k: v for k, v in options.items() if k != "health_check_interval"}
        cluster_opts["ssl"] = first.scheme.startswith("rediss")
        return makers.cluster(startup_nodes=[makers.node(h, p) for h, p in nodes],
                              **auth, **cluster_opts)
    sentinel = makers.sentinel(nodes, sentinel_kwargs=_sentinel_kwargs(sentinel_kwargs),
                               **options)
    return sentinel.master_for(str(master_name), redis_class=makers.master, **auth,
                               **_db(first))


class SentinelMaster(redis.Redis):
    """The master's client, which also closes its connections to the sentinels."""

    def close(self) -> None:
        """Close the master's connections and the sentinels'."""
        super().close()
        for sentinel in self.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
            sentinel.close()


class AsyncSentinelMaster(aioredis.Redis):
    """:class:`SentinelMaster` on ``redis.asyncio``."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        """Close the master's connections and the sentinels'."""
        await super().aclose(close_connection_pool)
        for sentinel in self.connection_pool.sentinel_manager.sentinels:  # type: ignore[attr-defined]
            await sentinel.aclose()


class LazyCluster:
    """A sync ``RedisCluster``, made at its first use, whose failures are ``RedisError``.

    redis-py's sync ``RedisCluster`` connects in its constructor and reports
    an unreachable cluster as ``RedisClusterException``, which is not a
    ``RedisError``.  A worker that starts while the cluster is down, or loses
    it, must meet the ``throttle_on_error`` policy (which catches
    ``RedisError``), not a crash: so the client is made on first use and that
    exception arrives as ``redis.ConnectionError``.  Scripts are registered
    without connecting (``Script`` only needs an encoder).
    """

    def __init__(self, factory: Callable[[], RedisCluster]) -> None:
        self._factory = factory
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def _real(self) -> RedisCluster:
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._factory()
                except RedisClusterException as exc:
                    raise redis.ConnectionError(str(exc)) from exc
            return self._client

    def register_script(self, script: str) -> Script:
        """A script of this client (no I/O: the first call loads it)."""
        return Script(cast(RedisCluster, self), script)

    def get_encoder(self) -> Encoder:
        """How scripts are encoded: the defaults (no ``decode_responses``)."""
        encoder: Any = Encoder  # untyped in redis-py
        return cast(Encoder, encoder("utf-8", "strict", False))

    def close(self) -> None:
        """Close the real client, if it was ever made."""
        with self._lock:
            if self._client is not None:
                self._client.close()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real(), name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except RedisClusterException as exc:
                raise redis.ConnectionError(str(exc)) from exc

        # Kept, so the next call of the method (every decision) finds it at once.
        self.__dict__[name] = call
        return call


class AsyncCluster(AsyncRedisCluster):
    """redis-py's asyncio ``RedisCluster``, whose failures are ``RedisError`` (see
    :class:`LazyCluster`): an unreachable cluster arrives as ``redis.ConnectionError``."""

    async def initialize(self, *args: Any, **kwargs: Any) -> AsyncRedisCluster:
        """Find the cluster's nodes (on first use)."""
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise redis.ConnectionError(str(exc)) from exc

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """Run one command (scripts included), cluster failures as ``ConnectionError``."""
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise redis.ConnectionError(str(exc)) from exc


# redis-py's sync Sentinel and ClusterNode have no annotations: Any, through _Makers.
_SYNC = _Makers(server=redis.Redis.from_url,
                cluster=lambda **kw: LazyCluster(lambda: RedisCluster(**kw)),
                node=ClusterNode, sentinel=Sentinel, master=SentinelMaster)
_ASYNC = _Makers(server=aioredis.Redis.from_url, cluster=AsyncCluster,
                 node=AsyncClusterNode, sentinel=AsyncSentinel, master=AsyncSentinelMaster)


def _parts(url: str) -> list[Any]:
    return [urlsplit(p.strip()) for p in url.split(";") if p.strip()]


def _split(url: str) -> tuple[Any, list[tuple[str, int]], dict[str, Any]]:
    """The first part, every (host, port), and the credentials of the first part."""
    parts = _parts(url)
    default = 26379 if parts[0].scheme == "sentinel" else 6379
    nodes = [(str(p.hostname), p.port or default) for p in parts]
    first = parts[0]
    auth: dict[str, Any] = {}
    if first.password:
        auth["password"] = unquote(first.password)
    if first.username:
        auth["username"] = unquote(first.username)
    return first, nodes, auth


def _db(part: Any) -> dict[str, Any]:
    db = part.path.strip("/")
    return {"db": int(db)} if db.isdigit() else {}


def _sentinel_kwargs(given: Mapping[str, Any] | None) -> dict[str, Any]:
    # A sentinel that does not answer must not hold a decision for the
    # master's read timeout: it is skipped after SENTINEL_TIMEOUT.
    out: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT,
                           "socket_connect_timeout": SENTINEL_TIMEOUT}
    out.update(given or {})
    return out
