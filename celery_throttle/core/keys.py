"""Where the core's state lives: every key name the core uses is built here.

A limit's keys: ``{<prefix>}:<kind>:<digest>:<name>``, where ``kind`` is
``b`` (a rate bucket), ``q`` (its line of waiting tasks), ``t`` (the
turns of a fair line), ``h`` (why a provider's report holds it back),
``o`` (an operator paused it), ``r`` (its learned rate, if it learns),
``l`` (a concurrency limit's leases), ``m`` (its meta
hash), ``k`` (its line of tasks waiting for a seat; never fair, it has no
turns), and ``digest`` is the hashed key
value of a per-key limit (tenant id, API key, ...) or ``-`` for a shared
one.  The name comes last, after two parts of fixed form, so a limit name
can hold any character (``:`` included) and still never be the key of
another limit, nor of the package's own keys: those (``epoch``, ``live``,
``enforce``, ``stops``, ``learners``, ``bell``, ``freed``, ``wait:*``, ``copy:*``, ``arrived:*``,
``counts:*``, and the waiting room's ``room:*``) start with a word no limit
key starts with.

* The prefix is the key's *first* ``{...}`` group, i.e. its Redis Cluster hash
  tag.  One decision may span several buckets (a tenant rate, a provider rate,
  a token budget) and must run as one script on one node, and the same bucket
  takes part in decisions with different partners, so every key of one
  prefix hashes to one place in a cluster.  User data comes after the tag and
  can never move a key to another shard.
* The waiting room keeps its own keys (``room/keys.py``) under a part of
  the prefix of its own, named there, not here; the core names a limit's
  line (what a decision reads of it) and the doorbell a freed seat rings.
  Tasks leave notes under
  ``{<prefix>}:<kind>:<task id digest>``: same hash tag, so a script that
  books a start and one that parks the task may touch both.
* Key values are always hashed (BLAKE2b, 128 bits) after a type tag: values
  of any length map to 22 URL-safe base64 characters (short key names keep a
  bucket under 100 bytes of Redis memory), distinct values (``1`` and ``"1"``,
  ``"Acme"`` and ``"acme"``, NFC and NFD forms) never share a bucket, and an
  API key used as a key value never appears in Redis, in logs or in errors.
"""

from __future__ import annotations

import base64
import hashlib
import uuid

__all__ = [
    "bell_key",
    "bucket_key",
    "copy_key",
    "counts_key",
    "enforce_key",
    "epoch_key",
    "freed_key",
    "held_key",
    "key_digest",
    "learned_key",
    "learners_key",
    "leases_key",
    "limit_of",
    "line_key",
    "line_of",
    "live_key",
    "meta_key",
    "operator_key",
    "seat_line_key",
    "sibling_key",
    "side_key",
    "split_limit_key",
    "stop_field",
    "stops_key",
    "task_key",
    "turns_key",
    "validate_name",
    "validate_prefix",
]

_MAX_NAME = 200


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is usable as a hash tag, else raise ``ValueError``."""
    if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(
            f"invalid key prefix {prefix!r}: expected a non-empty string without '{{' or '}}'"
        )
    return prefix


def validate_name(name: object) -> str:
    """Return ``name`` if it is a usable limit name, else raise ``ValueError``."""
    if not isinstance(name, str) or not name.strip() or len(name) > _MAX_NAME:
        raise ValueError(
            f"invalid limit name {name!r}: expected a non-empty string of at most "
            f"{_MAX_NAME} characters"
        )
    return name


def key_digest(value: object) -> str:
    """Hash a caller-supplied key value to 22 URL-safe characters (128 bits), tagged by type.

    Accepted: ``str``, ``bytes``, ``int`` and ``uuid.UUID`` (UUIDs hash like
    their string form, because Celery's JSON serializer turns them into one).
    Anything else, ``None`` and ``bool`` included, is almost always a bug in
    the caller and raises ``TypeError`` naming the type (never the value: it
    may be a secret).
    """
    if isinstance(value, bool) or value is None:
        raise TypeError(f"invalid key value of type {type(value).__name__}: "
                        "expected str, bytes, int or uuid.UUID")
    if isinstance(value, uuid.UUID):
        value = str(value)
    if isinstance(value, str):
        data = b"s:" + value.encode("utf-8", "surrogatepass")
    elif isinstance(value, bytes | bytearray | memoryview):
        data = b"b:" + bytes(value)
    elif isinstance(value, int):
        data = b"i:" + str(value).encode("ascii")
    else:
        raise TypeError(f"invalid key value of type {type(value).__name__}: "
                        "expected str, bytes, int or uuid.UUID")
    digest = hashlib.blake2b(data, digest_size=16).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def bucket_key(prefix: str, name: str, key: object = None) -> str:
    """The Redis key of the rate bucket ``name`` (and key value ``key``, if given)."""
    return _limit_key("b", prefix, name, key)


def line_key(prefix: str, name: str, key: object = None) -> str:
    """The line of tasks waiting for rate limit ``name`` (and ``key``): a sorted set."""
    return _limit_key("q", prefix, name, key)


def seat_line_key(prefix: str, name: str, key: object = None) -> str:
    """The line of tasks waiting for a seat of concurrency limit ``name``: a sorted set."""
    return _limit_key("k", prefix, name, key)


#: A limit key's kind -> the kinds of its line and of that line's turns: a rate
#: bucket's line (``q``, ``t``) and a concurrency limit's line for a seat (``k``).  A
#: seat's line is never fair, so it has no turns: its line stands in their place among
#: a script's keys, where nothing reads or writes turns for it.
LINES = {"b": ("q", "t"), "l": ("k", "k")}


def line_of(key: str) -> tuple[str, str]:
    """The line and turns keys of the limit whose bucket or leases key is ``key``."""
    line, turns = LINES[split_limit_key(key)[0]]
    return sibling_key(key, line), sibling_key(key, turns)


def limit_of(line: str) -> str:
    """The bucket or leases key of the limit whose line is ``line`` (:func:`line_of`)."""
    kind = split_limit_key(line)[0]
    return sibling_key(line, next(k for k, (q, _) in LINES.items() if q == kind))


def split_limit_key(key: str) -> tuple[str, str, str]:
    """A limit key's (kind, key digest or "-", name); ``ValueError`` for any other key."""
    tag = key.find("}") + 1
    parts = key[tag + 1:].split(":", 2) if key[tag: tag + 1] == ":" else []
    if len(parts) != 3 or len(parts[0]) != 1:
        raise ValueError("not a limit key of this package")
    kind, digest, name = parts
    return kind, digest, name


def sibling_key(key: str, kind: str) -> str:
    """The key of kind ``kind`` of the limit (name and key value) whose key is ``key``:
    a bucket's line (``q``) or turns (``t``), a line's bucket (``b``)."""
    split_limit_key(key)  # (raises for any other key)
    tag = key.find("}") + 1
    return f"{key[:tag + 1]}{kind}{key[tag + 2:]}"


def side_key(key: str) -> str:
    """The side key of the limit whose key is ``key``: a concurrency limit's meta hash
    (``m``), a rate bucket's learned rate (``r``), as the scripts take them
    (``lua/limits.lua``)."""
    return sibling_key(key, "m" if split_limit_key(key)[0] == "l" else "r")


def held_key(prefix: str, name: str, key: object = None) -> str:
    """Why a rate limit is held back by a provider's report (``Gate.follow``): a string
    "remaining reset_us reported_us" that expires at the provider's reset."""
    return _limit_key("h", prefix, name, key)


def operator_key(prefix: str, name: str, key: object = None) -> str:
    """A limit paused by an operator (``celery throttle pause``, the dashboard), not by a
    provider's 429: a string that expires with the pause."""
    return _limit_key("o", prefix, name, key)


def turns_key(prefix: str, name: str, key: object = None) -> str:
    """The turns of a fair line (``room/lines.py``): a hash, key value digest -> last turn."""
    return _limit_key("t", prefix, name, key)


def learned_key(prefix: str, name: str, key: object = None) -> str:
    """A rate limit's learned rate (``lua/learn.lua``), if it learns: a hash that
    outlives its bucket."""
    return _limit_key("r", prefix, name, key)


def leases_key(prefix: str, name: str, key: object = None) -> str:
    """A concurrency limit's leases: a sorted set, holder -> lease expiry."""
    return _limit_key("l", prefix, name, key)


def meta_key(prefix: str, name: str, key: object = None) -> str:
    """A concurrency limit's hash: average run, holders' starts, pacing cursor, pause."""
    return _limit_key("m", prefix, name, key)


def _limit_key(kind: str, prefix: str, name: str, key: object) -> str:
    digest = "-" if key is None else key_digest(key)
    return f"{{{prefix}}}:{kind}:{digest}:{name}"


def copy_key(prefix: str, task_id: str, retries: int) -> str:
    """The copy pointer of one run (``retries``) of a task: which copy may go on."""
    return f"{task_key(prefix, 'copy', task_id)}:{retries}"


def bell_key(prefix: str) -> str:
    """The dispatchers' doorbell (``lua/bell.lua``): a list of at most one token, rung
    where a task is due sooner than a sleeping dispatcher would look (a seat given back,
    a task parked or put in line first)."""
    return f"{{{prefix}}}:bell"


def freed_key(prefix: str) -> str:
    """The lines of the limits a seat was given back in (``lua/release.lua``): a set of line
    keys, due at once; the waiting room's dispatch empties it into its ready index."""
    return f"{{{prefix}}}:freed"


def task_key(prefix: str, kind: str, task_id: str) -> str:
    """A per-task key (``wait`` note, ``arrived`` marker, ...); the task id is hashed."""
    return f"{{{prefix}}}:{kind}:{key_digest(task_id)}"


def counts_key(prefix: str, second: int) -> str:
    """The workers' counts of one wall-clock second (``integration/history.py``): a hash,
    ``<field>:<limit name>`` -> count."""
    return f"{{{prefix}}}:counts:{second}"


def enforce_key(prefix: str) -> str:
    """Limits switched in or out of shadow mode at run time (``live.py``): a hash, limit
    name -> "1" (enforced) or "0" (shadow)."""
    return f"{{{prefix}}}:enforce"


def stops_key(prefix: str) -> str:
    """The limits stopped until resumed (``core/stops.py``): a hash, :func:`stop_field` ->
    why (JSON)."""
    return f"{{{prefix}}}:stops"


def stop_field(name: str, key: object = None) -> str:
    """A limit's field in :func:`stops_key`: its key value's digest (``-`` for a shared
    limit) and its name, as in its own keys."""
    return f"{'-' if key is None else key_digest(key)}:{name}"


def learners_key(prefix: str) -> str:
    """The limits that learn their rate, as gated clients wrote them (``learners.py``): a
    hash, limit name -> "rate burst floor per_key"."""
    return f"{{{prefix}}}:learners"


def live_key(prefix: str) -> str:
    """The limits' run-time overrides (``live.py``): a hash, limit name -> rate."""
    return f"{{{prefix}}}:live"


def epoch_key(prefix: str) -> str:
    """The prefix's epoch: when its state began (a restart or flush without it starts anew)."""
    return f"{{{prefix}}}:epoch"
