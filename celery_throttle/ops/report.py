"""What every limit looks like now, as data: ``celery throttle status --json`` and the dashboard.

One home for the state a person reads, so the terminal and the web page can
never disagree: :func:`status` is the document ``status --json`` prints and
``/api/status`` serves; :func:`why` is ``why --json``'s.  Per-key buckets are
never listed (a key scan, and key values are stored hashed): one is read when
its key value is given; the keys with most tasks waiting are listed by digest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from celery import Celery

from ..core import learners, stops
from ..core.gate import Gate
from ..core.keys import operator_key, stop_field, stops_key
from ..core.limits import BucketState, Concurrency, LeaseState, Limit
from ..core.rates import parse_rate
from ..core.stops import parse
from ..integration.declared import KnownLimit, known_limits
from ..integration.history import SPAN, read_counts
from ..integration.notes import read_wait
from ..integration.runtime import runtime_for
from ..integration.shadow import enforced

__all__ = ["ROOM_OFF", "UnknownLimit", "select", "status", "why"]

#: ``waiting_room.because`` when the app does not use the waiting room at all.
ROOM_OFF = "throttle_waiting_room is False"


class UnknownLimit(ValueError):
    """A limit name the app does not declare."""


def select(app: Celery, names: Sequence[str]) -> list[KnownLimit]:
    """The app's limits named ``names`` (all of them when empty); raises :class:`UnknownLimit`."""
    known = known_limits(app)
    if not names:
        return known
    by_name = {k.limit.name for k in known}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise UnknownLimit(f"unknown limit {missing[0]!r}; known: "
                           f"{', '.join(sorted(by_name)) or 'none'}")
    return [k for k in known if k.limit.name in names]


def status(app: Celery, names: Sequence[str] = (), value: object = None) -> dict[str, Any]:
    """Every limit's state (of ``names``; for key value ``value`` of per-key limits).

    ``{"limits": [row, ...], "waiting_room": {...}, "in_line": n, "at": unix time}``.
    """
    runtime = runtime_for(app)
    gate = runtime.gate
    live = runtime.live.read()
    rows = []
    # A name no task declares is known while its limit is stopped, or if it learns its
    # rate (a gated client's: ``_clients_rows`` shows it); ``select`` refuses the others.
    undeclared = set(names) - {k.limit.name for k in known_limits(app)}
    clients = _clients(gate, value) if undeclared or not names else []
    asked = [n for n in names if n not in {known.limit.name for known in clients}]
    selected = select(app, asked) if asked or not names else []
    for known in selected:
        if isinstance(known.limit, Limit) and known.limit.name in live:
            rate, burst = live[known.limit.name]
            known = dataclasses.replace(known, limit=dataclasses.replace(
                known.limit, rate=rate, burst=burst, cost=min(known.limit.cost, burst)),
                code=(known.limit.rate, known.limit.burst))
        if known.keyed and value is None:
            rows.append((_lease_row if isinstance(known.limit, Concurrency) else _row)(
                known, None, False))
            continue
        lim = known.limit
        if isinstance(lim, Concurrency):
            lim = dataclasses.replace(lim, key=value) if known.keyed else lim
            rows.append(_lease_row(known, gate.inspect_leases(lim), value is not None))
            continue
        if known.keyed:
            lim = Limit(lim.name, lim.rate, lim.burst, value, lim.cost)
        rows.append(_row(known, gate.inspect(lim), value is not None))
    intervals = {r["limit"]: parse_rate(r["rate"]).interval_us for r in rows if "rate" in r}
    lines = {line.name: line for line in runtime.room.lines.busiest(intervals)}
    for r in rows:
        line = lines.get(r["limit"])
        if line is not None and "rate" in r:
            r.update(in_line=line.waiting, drains_in_s=line.drains_in,
                     top_keys=[{"key_digest": d, "waiting": n} for d, n in line.top])
    _clients_rows(gate, rows, clients, names, value)
    _paused_by(runtime.gate, rows, value)
    # (A rate limit and a concurrency limit may share a name: one row each.)
    _shadow(app, rows, {(k.limit.name, isinstance(k.limit, Limit)): k for k in selected},
            value)
    room = runtime.room.state()
    in_line = runtime.room.lines.waiting()
    # Whether waiting tasks may wait in the store now (room/durability.py).
    verdict = runtime.durability.verdict() if runtime.config.waiting_room else None
    keeper = runtime.room.keeper
    return {"limits": rows, "waiting_room": {
        **dataclasses.asdict(room), "in_use": verdict is not None and verdict.safe,
        "because": verdict.reason if verdict is not None else ROOM_OFF,
        "kept_beside_broker": verdict is not None and verdict.kept,
        # Waiting tasks with a copy on the broker's server (room/keeper.py).
        "kept": keeper.count() if keeper is not None else 0},
        "in_line": in_line, "at": time.time()}


def why(app: Celery, task_id: str) -> dict[str, Any]:
    """Why ``task_id`` waits: ``{"task_id": ..., "waiting": note or None}`` (``notes.py``)."""
    return {"task_id": task_id, "waiting": read_wait(runtime_for(app), task_id)}


def _shadow(app: Celery, rows: list[dict[str, Any]], known: dict[tuple[str, bool], KnownLimit],
            value: object) -> None:
    """Each row's mode (``enforced``, and ``enforced_by``: "live", "code" or "app"); for a
    limit in shadow mode, what it would have done (``shadow``): its shadow bucket's next
    free start (when the would-have backlog drains) and starts booked ahead, and the
    tasks it would have made wait in the last 15 minutes (every worker's counts)."""
    runtime = runtime_for(app)
    shadowed = []
    for r in rows:
        k = known.get((r["limit"], "rate" in r))
        r["enforced"], r["enforced_by"] = enforced(runtime, r["limit"],
                                                   k.enforce if k is not None else None)
        if not r["enforced"]:
            shadowed.append(r)
    if not shadowed:
        return
    now = int(time.time())
    counts = read_counts(runtime.gate.client, runtime.config.prefix,
                         range(now - SPAN, now + 1))
    for r in shadowed:
        would = [c.get(r["limit"], {}) for c in counts.values()]
        fig: dict[str, Any] = {
            "would_defer_15m": int(sum(w.get("would_defer", 0) for w in would)),
            "would_wait_s_15m": round(sum(w.get("would_wait_seconds_sum", 0) for w in would), 3)}
        lim = known[r["limit"], "rate" in r].limit
        if isinstance(lim, Limit) and (value is not None or not r["per_key"]):
            state = runtime.shadow.inspect(Limit(lim.name, parse_rate(r["rate"]), r["burst"],
                                                 value if r["per_key"] else None, lim.cost))
            fig.update(would_next_free_s=round(state.next_free, 3),
                       would_booked_ahead=state.booked_ahead)
        r["shadow"] = fig


def _clients(gate: Gate, value: object) -> list[KnownLimit]:
    """The limits gated clients use that the store knows without any task declaring them:
    the stopped ones (a stop's record has the rate) and the ones that learn their rate
    (``core/learners.py``)."""
    label = ("(no task: a gated client's)",)
    found = {stop.limit: KnownLimit(limit, stop.per_key, label) for stop in gate.stops(value)
             if (limit := stops.limit_of(stop, value)) is not None}
    for lim, per_key in learners.read(gate.client, gate.prefix, value):
        found[lim.name] = KnownLimit(lim, per_key, label)
    return list(found.values())


def _clients_rows(gate: Gate, rows: list[dict[str, Any]], clients: Sequence[KnownLimit],
                  names: Sequence[str], value: object) -> None:
    """Add a row for each of ``clients`` (:func:`_clients`) that no row shows, of ``names``
    (all when empty)."""
    shown = {r["limit"] for r in rows}
    for known in clients:
        lim = known.limit
        if lim.name in shown or (names and lim.name not in names):
            continue
        assert isinstance(lim, Limit)
        rows.append(_row(known, gate.inspect(lim) if value is not None or not known.keyed
                         else None, value is not None))
        shown.add(lim.name)


def _paused_by(gate: Gate, rows: list[dict[str, Any]], value: object) -> None:
    """Say who paused each paused limit: ``"operator"`` (``control.pause``),
    ``"provider"`` (a provider's 429, or code calling ``Gate.pause``) or ``"money"`` (a
    provider said the money is spent: ``stopped`` says since when and its words)."""
    paused = [r for r in rows if r.get("paused_s")]
    if not paused:
        return
    stops = gate.client.hmget(stops_key(gate.prefix), [
        stop_field(r["limit"], value if r["per_key"] else None) for r in paused])
    for r, raw in zip(paused, stops, strict=True):
        stop = parse(raw)
        if stop is not None:
            r["paused_by"] = "money"
            r["stopped"] = {"reason": stop.reason, "message": stop.message, "since": stop.at}
    paused = [r for r in paused if "stopped" not in r]
    if not paused:
        return
    pipe = gate.client.pipeline(transaction=False)
    for r in paused:
        pipe.exists(operator_key(gate.prefix, r["limit"], value if r["per_key"] else None))
    for r, by_operator in zip(paused, pipe.execute(), strict=True):
        r["paused_by"] = "operator" if by_operator else "provider"


def _lease_row(known: KnownLimit, state: LeaseState | None, key_given: bool
               ) -> dict[str, Any]:
    lim = known.limit
    assert isinstance(lim, Concurrency)
    row: dict[str, Any] = {
        "limit": lim.name, "concurrency": lim.seats, "lease_s": lim.lease,
        "per_key": known.keyed, "used_by": list(known.used_by),
    }
    if state is None:
        row["note"] = "per key: name one with --key" if known.keyed and not key_given else ""
        return row
    row.update(held=state.held, paused_s=round(state.paused, 3),
               average_run_s=round(state.average_run, 3))
    return row


def _row(known: KnownLimit, state: BucketState | None, key_given: bool) -> dict[str, Any]:
    lim = known.limit
    assert isinstance(lim, Limit)
    row: dict[str, Any] = {
        "limit": lim.name, "rate": str(lim.rate), "burst": lim.burst,
        "per_key": known.keyed, "used_by": list(known.used_by),
    }
    if known.code is not None:  # set at run time over the code's
        row["code_rate"], row["code_burst"] = str(known.code[0]), known.code[1]
    if state is None:
        row["note"] = "per key: name one with --key" if known.keyed and not key_given else ""
        return row
    row.update(used=round(state.used, 3), fill=round(min(state.used, lim.burst) / lim.burst, 3),
               next_free_s=round(state.next_free, 3), booked_ahead=state.booked_ahead,
               ttl_s=round(state.ttl, 3), paused_s=round(state.paused, 3))
    if state.held_remaining is not None:  # the provider's own count holds it back
        row["held_by_provider"] = {"remaining": state.held_remaining,
                                   "until_reset_s": round(state.held, 3),
                                   "reported_s_ago": round(state.held_since, 3)}
    if (learned := state.learned) is not None:  # it learns its rate (below "rate")
        row["learned"] = {"rate_per_s": round(learned.rate, 4), "moved": learned.why or None,
                          "moved_s_ago": round(learned.since, 3) if learned.why else None,
                          "before_per_s": round(learned.before, 4) if learned.why else None}
    return row
