"""The ``throttle_*`` settings, read once per app into a frozen :class:`Config`.

Precedence, written once: a ``@throttled(..., max_wait=...)`` argument beats
the ``throttle_max_wait`` setting, which beats the built-in default below.
Queue limits (``throttle_queues``) add to a task's own limits; they never
replace them: a task consumed from a limited queue passes both, atomically.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from redis.cluster import RedisCluster

from ..core.connect import check_url, connect, kind_of
from ..core.keys import key_digest, validate_prefix
from ..core.limits import Limit
from ..core.rates import parse_rate
from ..errors import ThrottleConfigError
from ..room.ladder import MAX_DELAY_MS
from ..room.native import patched
from ..values import seconds

__all__ = ["REMOVED", "SETTINGS", "Config", "QueueLimit", "read_config"]

_POLICIES = ("defer", "allow", "fail")

#: Every setting: (default, meaning), written once: docs/guide/settings.md is its table
#: (test_docs compares them).  A default the code computes is None here, and the
#: meaning ends with "; default: " and what it is.
SETTINGS: dict[str, tuple[object, str]] = {
    "throttle_redis_url": (None,
        "the store: one server (`redis://`, `rediss://`, `unix://`), Sentinel "
        "(`sentinel://h:26379;sentinel://h2:26379`) or Cluster (`redis+cluster://h:7000`): "
        "see [stores](stores.md); default: `broker_url` when it is one of these"),
    "throttle_sentinel_master": (None,
        "the master's name, for a `sentinel://` store; default: "
        '`broker_transport_options["master_name"]`'),
    "throttle_sentinel_kwargs": (None,
        "options of the connections to the sentinels themselves (their password, TLS); "
        'default: `broker_transport_options["sentinel_kwargs"]`'),
    "throttle_park_replicas": (None,
        "a task parked in the waiting room (or put in line) is acknowledged once this many "
        "replicas have it (`WAIT`, at most 0.5 s; then a WARNING); default: `1` with a "
        "`sentinel://` store, else `0`"),
    "throttle_prefix": ("throttle",
        "key prefix and Redis Cluster hash tag of every bucket"),
    "throttle_queues": ({},
        '`{queue: rate}` or `{queue: {"rate": r, "burst": b}}`: a limit on every task '
        "consumed from that queue"),
    "throttle_on_error": ("defer",
        'the store is down: `"defer"` (re-schedule with a jittered backoff of 0.5-30 s, never run '
        'unthrottled), `"allow"` (run unthrottled, WARNING), `"fail"` (task fails with '
        "`ThrottleStoreError`)"),
    "throttle_max_wait": (None,
        "seconds a task may wait in total before it fails with `ThrottleTimeout` (a "
        "decorator's `max_wait` wins); `None`: no limit"),
    "throttle_horizon": (3600.0,
        "where a waiting task is re-published with a countdown (the waiting room is off, or "
        "the store would lose it): how far ahead (s) it books its start; a longer wait comes "
        "back when one is within reach"),
    "throttle_max_countdown": (None,
        "longest single countdown (s); longer waits take several hops; default: half the "
        "broker's `visibility_timeout` (Redis, SQS), at most 900; on RabbitMQ the delay "
        "ladder's longest, 49 days (a countdown waits in the broker, held by no worker)"),
    "throttle_max_sleep": (0.5,
        "a booked start this close (s) is slept for in the worker instead of re-publishing; "
        "where the task would wait in line, at most the dispatch lead plus the measured trip "
        "(a longer wait waits in line)"),
    "throttle_claim_grace": (None,
        "how late (s) a task may start in its booked start; later it asks again; default: half"
        " the booked start (cost x interval), 0.02-0.25"),
    "throttle_waiting_room": (True,
        "tasks that must wait longer than a sleep in the worker wait in Redis, in the line of"
        " the limit that blocks them, and are dispatched to their queue when it admits them, "
        "best priority first, where they are kept as well as in the broker (the store is the "
        "broker's server, appends to disk, waits for replicas, or a copy is kept beside the "
        "broker); else, and with `False`, they are re-published with a countdown; "
        '`"always"`: on any store (see [where a waiting task waits](waiting.md))'),
    "throttle_keep_beside_broker": (True,
        "where the store alone would lose waiting tasks (no `appendonly`, not the broker's "
        "server) and the broker is a Redis server or RabbitMQ: tasks wait in the store anyway, "
        "each kept on the broker too (a copy beside a Redis broker's queues, a record in a log "
        "on RabbitMQ) and restored from there if the store comes back empty; `False`: such "
        "waits are re-published with a countdown (see [kept beside the "
        "broker](waiting.md#kept-beside-the-broker))"),
    "throttle_enforce": (True,
        "`False`: shadow mode for every limit of the app: each decision is made and counted "
        "(would have waited, how long, for which limit) but every task runs at once; "
        "`@throttled(enforce=...)` overrides it per limit, `celery throttle shadow NAME "
        "on|off` overrides both (see [shadow mode](observability.md#shadow-mode))"),
    "throttle_priority_ageing": (3600.0,
        "seconds of waiting in line that are worth one priority level: a waiting task moves "
        "up one level per step, so urgent work never starves the rest for ever"),
    "throttle_fair_weights": ({},
        "`{limit name: {fair key value: weight}}`: a fair limit's line serves a value weight "
        "times as often as a value of weight 1 (the default)"),
    "throttle_dispatch_lead": (None,
        "the waiting room dispatches a task this many seconds before its start besides the "
        "measured broker trip (it sleeps the rest): a green pool's loop delays an arrival "
        "while the node takes in a burst, and a green thread sleeps for free; default: 0.05, "
        "or 0.15 on the gevent and eventlet pools"),
    "throttle_pool_check_interval": (None,
        "the worker also checks this often (s) for a pool process that exited and starts its "
        "replacement: Celery's own check of a process that exits just after it was sent a "
        "task runs every 5 s, and the task waits for it; `0`: Celery's checks only (see "
        "[worker pools](pools.md)); default: 0.25 where prefork pool processes are recycled"),
    "throttle_dispatch_timeout": (60.0,
        "a dispatched task that has not reached a worker after this many seconds is "
        "dispatched again (only the first copy to arrive runs)"),
    "throttle_gc_freeze": (True,
        "at the start of each pool process, move the objects it inherited into the garbage "
        "collector's permanent generation (`gc.freeze`): see [memory](memory.md)"),
    "throttle_metrics_port": (None,
        "serve Prometheus `/metrics` on this port from each worker node (needs "
        "`prometheus_client`; see [observability](observability.md)); `None`: off"),
}


@dataclass(frozen=True, slots=True)
class QueueLimit:
    """A limit on every task consumed from ``queue``."""

    queue: str
    limit: Limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The settings of one app, validated (defaults live in :data:`SETTINGS` only)."""

    redis_url: str = field(repr=False)  # may carry a password
    sentinel_master: str | None
    sentinel_kwargs: Mapping[str, Any] | None = field(repr=False)  # may carry a password
    park_replicas: int
    prefix: str
    queues: tuple[QueueLimit, ...]
    on_error: str
    max_wait: float | None
    horizon: float
    max_countdown: float
    max_sleep: float
    claim_grace: float | None
    metrics_port: int | None
    waiting_room: bool
    # throttle_waiting_room = "always": park whatever the store keeps (room/durability.py)
    park_anywhere: bool
    keep_beside_broker: bool  # the store alone is not safe: keep a copy on the broker's server
    priority_ageing: float
    # limit name -> fair key value digest -> weight (values are never kept in clear)
    fair_weights: Mapping[str, Mapping[str, int]] = field(default_factory=dict, repr=False)
    dispatch_lead: float
    pool_check_interval: float | None  # None: recycling.DEFAULT_INTERVAL
    dispatch_timeout: float
    gc_freeze: bool
    enforce: bool
    # Not a throttle_* setting: the broker's, read for max_countdown and for
    # how long a duplicate copy of an acks_late message can still turn up.
    visibility_timeout: float
    # Not settings either: is the store the broker (its URL), and the broker's URL when
    # it is a Redis server (compared by server id, room/durability.py).
    store_is_broker: bool = False
    broker_redis_url: str | None = field(default=None, repr=False)  # may carry a password
    broker_amqp: bool = False  # the broker is RabbitMQ (waiting tasks kept in its log)

    @property
    def high_priority_first(self) -> bool:
        """How the broker orders priorities: AMQP brokers deliver a higher number first,
        kombu's Redis and others a lower one."""
        return self.broker_amqp

    def connect(self, **options: Any) -> redis.Redis | RedisCluster:
        """A new client of the store (one server, Sentinel's master, or a Cluster)."""
        return connect(self.redis_url, master_name=self.sentinel_master,
                       sentinel_kwargs=self.sentinel_kwargs, **options)

    def queue_limit(self, queue: str | None) -> Limit | None:
        """The limit of ``queue``, if it has one."""
        for q in self.queues:
            if q.queue == queue:
                return q.limit
        return None


def _seconds(name: str, value: object, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    try:
        return seconds(name, value)
    except ValueError:
        raise ThrottleConfigError(f"setting {name}={value!r}: expected seconds >= 0"
                                  + (" or None" if allow_none else "")) from None


def _queue_limits(value: object) -> tuple[QueueLimit, ...]:
    if not isinstance(value, Mapping):
        raise ThrottleConfigError(
            f"setting throttle_queues={value!r}: expected a dict of queue name to rate")
    out = []
    for queue, spec in value.items():
        where = f"setting throttle_queues[{queue!r}]"
        if not isinstance(queue, str) or not queue:
            raise ThrottleConfigError(f"{where}: a queue name must be a non-empty string")
        if isinstance(spec, str):
            spec = {"rate": spec}
        if not isinstance(spec, Mapping) or set(spec) - {"rate", "burst"} or "rate" not in spec:
            raise ThrottleConfigError(
                f"{where}={spec!r}: expected a rate such as '60/m' or "
                "{'rate': '60/m', 'burst': 5}")
        try:
            limit = Limit(f"queue:{queue}", parse_rate(spec["rate"]), spec.get("burst", 1))
        except ValueError as exc:
            raise ThrottleConfigError(f"{where}: {exc}") from exc
        out.append(QueueLimit(queue, limit))
    return tuple(out)


def _visibility_timeout(app: Celery) -> float:
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", 3600))  # kombu's Redis/SQS default


def _default_max_countdown(visibility: float | None) -> float:
    # kombu #337: with the Redis (and SQS) transport an ETA message that stays
    # unacknowledged longer than visibility_timeout is redelivered and runs
    # twice.  A single countdown stays at half of it; longer waits hop.  On an
    # AMQP broker (None) a countdown waits in the broker, on the delay ladder,
    # and no worker holds it: one trip, as long as the ladder's longest.
    if visibility is None:
        return MAX_DELAY_MS / 1000
    return max(1.0, min(900.0, visibility / 2))


#: Settings that earlier versions read, and what takes their place: naming one is an
#: error (it would otherwise be ignored, or taken for a typo of another setting).
REMOVED: dict[str, str] = {
    "throttle_seats_in_line": "a task with a concurrency limit always waits in the seat's "
                              "line; remove the setting",
    "throttle_line_on_arrival": "a worker always lines up an arriving task whose limit has "
                                "tasks in line; remove the setting",
    "throttle_scheduler": "a task that waits longer than a sleep in the worker always waits "
                          "in its limit's line (where the waiting room is open); remove the "
                          "setting",
}


def read_config(app: Celery) -> Config:
    """Read and validate ``app``'s ``throttle_*`` settings (raises :class:`ThrottleConfigError`)."""
    conf = app.conf
    # With config_from_object(..., namespace="CELERY") (Django's way) the keys
    # stay as written, CELERY_THROTTLE_QUEUES; Celery finds them by name.
    namespace = getattr(app, "namespace", None)  # (not in celery-types' stubs)
    spaced = f"{str(namespace).upper()}_" if namespace else None
    unknown = []
    for key in map(str, conf):
        plain = key[len(spaced):].lower() if spaced and key.upper().startswith(spaced) else key
        if plain.startswith("throttle_") and plain not in SETTINGS:
            unknown.append((key, plain))
    if unknown:
        key, plain = sorted(unknown)[0]
        if plain in REMOVED:
            raise ThrottleConfigError(f"setting {key!r} was removed in 0.2.0: {REMOVED[plain]}")
        hint = difflib.get_close_matches(plain, SETTINGS, n=1)
        shown = [f"{spaced}{name.upper()}" if key != plain else name
                 for name in (hint or list(SETTINGS))]
        raise ThrottleConfigError(
            f"unknown setting {key!r}"
            + (f"; did you mean {shown[0]!r}?" if hint else f"; known: {', '.join(shown)}"))

    def get(name: str) -> Any:
        return conf.get(name, SETTINGS[name][0])

    url = get("throttle_redis_url") or conf.broker_url or ""
    transport = conf.broker_transport_options or {}
    master = get("throttle_sentinel_master") or transport.get("master_name")
    sentinel_kwargs = get("throttle_sentinel_kwargs") or transport.get("sentinel_kwargs")
    if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, Mapping):
        raise ThrottleConfigError(
            f"setting throttle_sentinel_kwargs: expected a dict (got {type(sentinel_kwargs)})")
    try:
        kind = check_url(url, master)
    except ValueError as exc:
        raise ThrottleConfigError(f"setting throttle_redis_url: {exc}") from None
    replicas = get("throttle_park_replicas")
    if replicas is None:
        replicas = 1 if kind == "sentinel" else 0
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ThrottleConfigError(
            f"setting throttle_park_replicas={replicas!r}: expected an integer >= 0")
    if replicas and kind == "cluster":
        raise ThrottleConfigError(
            f"setting throttle_park_replicas={replicas!r}: not available with a "
            "redis+cluster:// store (WAIT goes through a pipeline there); use 0")
    on_error = get("throttle_on_error")
    if on_error not in _POLICIES:
        raise ThrottleConfigError(
            f"setting throttle_on_error={on_error!r}: expected one of {', '.join(_POLICIES)}")
    try:
        prefix = validate_prefix(get("throttle_prefix"))
    except ValueError as exc:
        raise ThrottleConfigError(f"setting throttle_prefix: {exc}") from exc
    max_countdown = _seconds("throttle_max_countdown", get("throttle_max_countdown"),
                             allow_none=True)
    visibility = _visibility_timeout(app)
    room = get("throttle_waiting_room")
    waiting_room = room == "always" or _flag("throttle_waiting_room", room, "or \"always\"")
    broker = conf.broker_url if isinstance(conf.broker_url, str) else None
    return Config(
        redis_url=url,
        sentinel_master=master,
        sentinel_kwargs=sentinel_kwargs,
        park_replicas=replicas,
        prefix=prefix,
        queues=_queue_limits(get("throttle_queues")),
        on_error=on_error,
        max_wait=_seconds("throttle_max_wait", get("throttle_max_wait"), allow_none=True),
        horizon=_seconds("throttle_horizon", get("throttle_horizon"), allow_none=False) or 0.0,
        max_countdown=max_countdown or _default_max_countdown(
            None if _amqp(conf.broker_url) else visibility),
        max_sleep=_seconds("throttle_max_sleep", get("throttle_max_sleep"),
                           allow_none=False) or 0.0,
        claim_grace=_seconds("throttle_claim_grace", get("throttle_claim_grace"),
                             allow_none=True),
        visibility_timeout=visibility,
        metrics_port=_port(get("throttle_metrics_port")),
        waiting_room=waiting_room,
        park_anywhere=room == "always",
        keep_beside_broker=_flag("throttle_keep_beside_broker",
                                 get("throttle_keep_beside_broker")),
        store_is_broker=url == broker,
        broker_redis_url=broker if _is_server(broker) else None,
        broker_amqp=_amqp(conf.broker_url),
        priority_ageing=_at_least_one("throttle_priority_ageing",
                                      get("throttle_priority_ageing")),
        fair_weights=_fair_weights(get("throttle_fair_weights")),
        dispatch_lead=_dispatch_lead(get("throttle_dispatch_lead")),
        pool_check_interval=_seconds("throttle_pool_check_interval",
                                     get("throttle_pool_check_interval"), allow_none=True),
        dispatch_timeout=_at_least_one("throttle_dispatch_timeout",
                                      get("throttle_dispatch_timeout")),
        gc_freeze=_flag("throttle_gc_freeze", get("throttle_gc_freeze")),
        enforce=_flag("throttle_enforce", get("throttle_enforce")),
    )


#: The dispatch lead's default (s), and on the gevent and eventlet pools: there
#: a dispatched task reaches its green thread only when the pool's loop gets
#: to it, later still while the node takes in a burst, so it is sent earlier.
#: A green thread sleeps the difference for free; a prefork process would be
#: held for it.
DISPATCH_LEAD, GREEN_DISPATCH_LEAD = 0.05, 0.15


def _dispatch_lead(value: object) -> float:
    if value is None:
        return GREEN_DISPATCH_LEAD if patched() else DISPATCH_LEAD
    return _seconds("throttle_dispatch_lead", value, allow_none=False) or 0.0


def _at_least_one(name: str, value: object) -> float:
    seconds = _seconds(name, value, allow_none=False) or 0.0
    if seconds < 1:
        raise ThrottleConfigError(f"setting {name}={value!r}: expected seconds >= 1")
    return seconds


def _fair_weights(value: object) -> dict[str, dict[str, int]]:
    where = "setting throttle_fair_weights"
    if not isinstance(value, Mapping):
        raise ThrottleConfigError(f"{where}: expected a dict of limit name to "
                                  f"{{fair key value: weight}}, got {type(value).__name__}")
    out: dict[str, dict[str, int]] = {}
    for name, weights in value.items():
        if not isinstance(name, str) or not isinstance(weights, Mapping):
            raise ThrottleConfigError(f"{where}[{name!r}]: expected a limit name and a dict of "
                                      "fair key value to weight")
        out[name] = {}
        for fair, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                # (the value itself may be a secret: its weight is named, not it)
                raise ThrottleConfigError(f"{where}[{name!r}]: weight {weight!r}: expected an "
                                          "integer >= 1")
            try:
                out[name][key_digest(fair)] = weight
            except TypeError as exc:
                raise ThrottleConfigError(f"{where}[{name!r}]: {exc}") from None
    return out


def _amqp(broker_url: object) -> bool:
    """The broker speaks AMQP (RabbitMQ): it delivers a higher priority number first."""
    first = str(broker_url or "").split(";")[0]
    return first.split("://")[0].lower() in ("amqp", "amqps", "pyamqp", "librabbitmq")


def _flag(name: str, value: object, other: str = "") -> bool:
    if not isinstance(value, bool):
        raise ThrottleConfigError(f"setting {name}={value!r}: expected True or False"
                                  + (f" {other}" if other else ""))
    return value


def _is_server(url: str | None) -> bool:
    """Is ``url`` one Redis server's (a broker the store may share a server with)?"""
    try:
        return url is not None and kind_of(url) == "server"
    except ValueError:
        return False


def _port(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ThrottleConfigError(f"setting throttle_metrics_port={value!r}: expected a TCP "
                                  "port (1-65535) or None")
    return value

