"""A waiting task's entry in a limit's line: its id, the record the dispatch reads, and
what a look at the lines reports (``lines.py`` keeps the lines themselves).

The record (``entry_json``) is one JSON object per waiting task: its task
id, its expiry and ``max_wait`` deadlines, one row per limit ([bucket,
interval, burst, cost, fair value, turn]; a concurrency limit's is [leases,
0, seats, lease]) and its place where a limit is fair.  ``serve.lua`` reads
it, and so do the readers here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.keys import key_digest, line_of, split_limit_key
from ..core.limits import AnyLimit, Concurrency, Limit, rates_of
from ..values import text

__all__ = [
    "InLine",
    "Line",
    "Served",
    "Weights",
    "ceiling_us",
    "entry_id",
    "entry_json",
    "fair_of",
    "limits_of",
    "lines_of",
    "name_of",
    "rows_of",
    "served_of",
    "task_of",
]


@dataclass(frozen=True, slots=True)
class Served:
    """A task dispatched from a line: publish ``message`` with ``token``, ``epoch``,
    ``flag`` ("c" charged for ``start``, server clock us: start then; "x" dispatched
    uncharged: revoked or expired, the worker drops it; "t": its ``max_wait`` passed)
    in its header."""

    entry: str
    token: str
    epoch: int
    flag: str
    start: int
    message: bytes


@dataclass(frozen=True, slots=True)
class InLine:
    """A task waiting in line: its ``place`` in its line (0: next), and its stored message."""

    entry: str
    limit: str
    key_digest: str  # the line's key value ("-": a shared limit's one line)
    place: int
    message: bytes


@dataclass(frozen=True, slots=True)
class Line:
    """The tasks waiting in line for one limit: every key value of a per-key limit together.

    ``top``: the key values with the most tasks waiting, as (key digest, tasks);
    a shared limit's one line is "-" (key values themselves are never stored).
    ``drains_in``: seconds until the line is empty at ``interval_us`` per task,
    for the longest line of a key value (key values are served side by side);
    an estimate: costs above one unit and other limits of the tasks lengthen it.
    """

    name: str
    waiting: int
    top: tuple[tuple[str, int], ...]
    drains_in: float | None


def entry_id(task_id: str, copy: str = "") -> str:
    """The waiting room's entry of ``task_id``'s message copy ``copy`` ("": the user's own
    message).  Named by the copy that waits, not by the one it becomes: a broker that
    delivers that copy again finds it waiting already."""
    return f"{key_digest(task_id)}:{copy or '-'}"


#: Fair-share weights: limit name -> fair key value digest -> weight (default 1).
Weights = Mapping[str, Mapping[str, int]]


def fair_of(limit: AnyLimit, weights: Weights) -> tuple[str, float]:
    """A limit's fair key value digest ("" for none) and the turn one task of it takes
    (its cost / its value's weight).  (A concurrency limit's line is not fair.)"""
    if not isinstance(limit, Limit) or limit.fair is None:
        return "", 0.0
    digest = key_digest(limit.fair)
    return digest, limit.cost / weights.get(limit.name, {}).get(digest, 1)


def entry_json(task_id: str, limits: Sequence[AnyLimit], prefix: str, *, place_us: int = 0,
               expires_us: int = 0, deadline_us: int = 0, weights: Weights | None = None
               ) -> str:
    """What the dispatch needs of a waiting task: its id, its expiry and ``max_wait``
    deadlines (server clock, us; 0: none), each limit's bucket (its name is in it), rate,
    cost and fair key value (digest and turn), and its place when a limit is fair (a fair
    line orders by turn; any other keeps the place as the task's score)."""
    rows: list[list[str | int | float]] = []
    for lim in limits:
        if isinstance(lim, Concurrency):  # (interval 0: a seat, for its lease)
            rows.append([lim.key_in(prefix).decode(), 0, lim.seats, lim.lease_us])
            continue
        fair, units = fair_of(lim, weights or {})
        row: list[str | int | float] = [lim.key_in(prefix).decode(),
                                        lim.interval_field if lim.adaptive
                                        else lim.rate.interval_us, lim.burst, lim.cost]
        if fair:  # (serve.lua reads a missing fair key value as none, and units as 1)
            row += [fair, units]
        rows.append(row)
    # One per waiting task: what the dispatch can do without is left out.
    task: dict[str, object] = {"t": task_id, "l": rows}
    if any(lim.fair is not None for lim in rates_of(limits)):
        task["p"] = place_us
    if expires_us:
        task["e"] = expires_us
    if deadline_us:
        task["w"] = deadline_us
    return json.dumps(task, separators=(",", ":"))


def served_of(epoch: int, items: Sequence[Any]) -> list[Served]:
    """serve.lua's dispatched tasks: entry, token, flag, start, message, one after another."""
    return [Served(text(items[k]), text(items[k + 1]), epoch, text(items[k + 2]),
                   int(items[k + 3]), items[k + 4]) for k in range(0, len(items), 5)]


def lines_of(record: bytes | str) -> list[str]:
    """The lines of a waiting task's limits, from its record (one of them holds it)."""
    task = task_of(record)
    return [line_of(bucket)[0] for bucket in limits_of(task)] if task else []


def task_of(raw: bytes | str) -> dict[str, Any] | None:
    try:
        task = json.loads(raw or b"null")
    except ValueError:
        return None
    return task if isinstance(task, dict) else None


def name_of(line: str) -> str | None:
    try:
        return split_limit_key(line)[2]
    except ValueError:
        return None


def rows_of(task: dict[str, Any]) -> list[tuple[str, int, int]]:
    """A waiting task's limits, the readable ones: (bucket key, interval when enqueued, us,
    burst: a concurrency limit's seats).""

    A row is [bucket, interval, burst, cost, ...]; a concurrency limit's is
    [leases, 0, seats, lease]: interval 0.  A rate limit that learns has "T/F"
    for its interval (``core/lua/learn.lua``): its ceiling's, T, is read."""
    limits = task.get("l")
    if not isinstance(limits, list):
        return []
    out = []
    for row in limits:
        if not (isinstance(row, list) and len(row) >= 4 and isinstance(row[0], str)
                and (":b:" in row[0] or ":l:" in row[0])):
            continue
        interval, burst = ceiling_us(row[1]), row[2]
        if interval is not None:
            out.append((row[0], interval, burst if isinstance(burst, int) else 1))
    return out


def ceiling_us(field: object) -> int | None:
    """A limit's interval field (``core/lua/limits.lua``) as its interval (us): a rate's, or
    the ceiling's of one that learns ("T/F"); None for anything else."""
    if isinstance(field, int) and not isinstance(field, bool):
        return field
    ceiling, slash, floor = str(field).partition("/")
    return int(ceiling) if ceiling.isdigit() and (not slash or floor.isdigit()) else None


def limits_of(task: dict[str, Any]) -> list[str]:
    """The bucket keys of a waiting task's limits (none of an unreadable record)."""
    return [bucket for bucket, _, _ in rows_of(task)]
