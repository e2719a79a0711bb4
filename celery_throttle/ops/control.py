"""The operator's actions on limits, shared by ``celery throttle ...`` and the dashboard.

Pause and resume a limit, set and unset a rate at run time, reset a bucket,
purge the waiting tasks.  Each checks its input first and raises
:class:`BadValue` (naming the value and the parameter) before touching the
store, so a bad request changes nothing.  ``value`` is a per-key limit's key
value; a shared limit ignores it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from celery import Celery

from ..core import stops
from ..core.keys import operator_key, stop_field, stops_key
from ..core.limits import Concurrency, Limit
from ..core.logs import logger
from ..core.rates import Rate, parse_rate
from ..core.stops import parse
from ..integration.declared import known_limits
from ..integration.notes import forget_dropped
from ..integration.runtime import runtime_for
from ..integration.visible import announce_dropped
from ..room.envelope import Envelope
from ..values import LONGEST_WAIT
from .report import select

__all__ = ["MOST_REVOKED", "BadValue", "NeedsKey", "Purged", "pause", "purge", "reset",
           "resume", "revoke_waiting", "set_rate", "shadow", "unset_rate", "waiting"]


class BadValue(ValueError):
    """An action's input is not usable; ``param`` names the parameter it came in."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class NeedsKey(ValueError):
    """The limit is per key and no key value was given."""


@dataclass(frozen=True, slots=True)
class Purged:
    """What :func:`purge` dropped: tasks, and how many the result backend marks REVOKED."""

    dropped: int
    revoked: int


def pause(app: Celery, name: str, seconds: float | None, value: object = None) -> float:
    """Admit nothing in limit ``name`` for ``seconds`` (None: until resumed, at most
    :data:`LONGEST_WAIT`); returns how long the pause lasts."""
    if seconds is not None and not 0 < seconds <= LONGEST_WAIT:
        raise BadValue(f"{seconds}: expected seconds from 0 to {LONGEST_WAIT:g}", "--for")
    limits = _limits_of(app, name, value)
    gate = runtime_for(app).gate
    lasts = gate.pause(limits, LONGEST_WAIT if seconds is None else seconds)
    # Who paused it, for status and the dashboard: a provider's 429 pauses it too.
    gate.client.set(operator_key(gate.prefix, name, limits[0].key), "1",
                    px=max(1, round(lasts * 1000)))
    return lasts


def resume(app: Celery, name: str, value: object = None) -> bool:
    """End a pause of limit ``name`` now, or its stop (a provider said the money is spent;
    also of a limit no task of the app declares, which only gated clients use); False if
    it was not paused."""
    runtime = runtime_for(app)
    limits = _stopped_alone(app, name, value) or _limits_of(app, name, value)
    ended = runtime.gate.resume(limits)
    runtime.gate.client.delete(operator_key(runtime.gate.prefix, name, limits[0].key))
    runtime.room.lines.look_now(name)  # its line was due when the pause would end
    return bool(ended)


def reset(app: Celery, name: str, value: object = None) -> list[tuple[str, bool, bool]]:
    """Forget limit ``name``'s bucket and/or leases: [("bucket" | "leases", existed,
    per key)]."""
    gate = runtime_for(app).gate
    return [("leases" if isinstance(lim, Concurrency) else "bucket", gate.reset(lim),
             lim.key is not None) for lim in _limits_of(app, name, value)]


def set_rate(app: Celery, name: str, rate: str, burst: int | None = None
             ) -> tuple[Rate, int, Limit]:
    """Set limit ``name`` to ``rate`` (and ``burst``; default the code's) everywhere, over
    the code's, until :func:`unset_rate`; returns the rate, burst and the code's limit."""
    limit = rate_limit(app, name)
    try:
        parsed = parse_rate(rate)
    except ValueError as exc:
        raise BadValue(str(exc), "RATE") from None
    burst = limit.burst if burst is None else burst
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise BadValue(f"{burst!r}: expected a whole number of at least 1", "--burst")
    runtime = runtime_for(app)
    runtime.live.set(name, parsed, burst)
    runtime.room.lines.look_now(name)  # its waiting tasks: at the new rate, now
    return parsed, burst, limit


def unset_rate(app: Celery, name: str) -> tuple[bool, Limit]:
    """Back to the code's rate for ``name``: (whether one was set, the code's limit)."""
    limit = rate_limit(app, name)
    runtime = runtime_for(app)
    had = runtime.live.unset(name)
    runtime.room.lines.look_now(name)
    return had, limit


def shadow(app: Celery, name: str, mode: str) -> tuple[bool | None, bool]:
    """Switch limit ``name`` into shadow mode ("on"), back to enforcing ("off"), or back
    to what the code and the app's setting say ("unset"), everywhere within a second;
    returns (whether a switch now enforces it, None when unset; whether one was set)."""
    if mode not in ("on", "off", "unset"):
        raise BadValue(f"{mode!r}: expected on, off or unset", "MODE")
    select(app, (name,))  # (an unknown name is an error, not a new switch)
    live = runtime_for(app).live
    had = name in live.read_enforce()
    if mode == "unset":
        live.unset_enforce(name)
        return None, had
    live.set_enforce(name, mode == "off")
    return mode == "off", had


def waiting(app: Celery) -> int:
    """Tasks waiting in the store: parked, on their way, and in line."""
    runtime = runtime_for(app)
    state = runtime.room.state()
    return state.parked + state.dispatching + runtime.room.lines.waiting()


def purge(app: Celery) -> Purged:
    """Drop every waiting task (they never run; the result backend marks them REVOKED, and
    a ``task-dropped`` event says so to Flower)."""
    runtime = runtime_for(app)
    dropped = runtime.room.purge()
    marked = forget_dropped(app, runtime, dropped, "purged from the waiting room")
    try:
        announce_dropped(app, dropped, "purged")
    except Exception as exc:  # the purge is done: an event listener is told nothing
        logger.warning("celery_throttle: purge: task-dropped events not sent: %s: %s",
                       type(exc).__name__, exc)
    return Purged(len(dropped), marked)


#: The most tasks :func:`revoke_waiting` finds for one limit in one call.
MOST_REVOKED = 100_000


def revoke_waiting(app: Celery, name: str, *, most: int = MOST_REVOKED) -> int:
    """Revoke every task waiting for limit ``name`` (in its line, or parked for it): the
    other limits' waiting tasks stay.  Returns how many were revoked.

    Celery's revoke (``app.control.revoke``) reaches every worker node, where the
    dispatcher passes a revoked task on without charging the limit and the
    worker drops it (the result backend marks it REVOKED): the limit is free
    at once, as after a purge.  A node started later does not know the
    revocation (Celery keeps it in memory, or in ``--statedb``).
    """
    select(app, (name,))
    runtime = runtime_for(app)
    ids = [Envelope.task_id_in(t.message)
           for t in runtime.room.lines.next_in_line(most, name, most=most)]
    for parked in runtime.room.next_parked(most):
        note = json.loads(parked.note) if parked.note else {}
        if note.get("limit") == name:
            ids.append(Envelope.task_id_in(parked.message))
    ids = sorted({i for i in ids if i})
    for at in range(0, len(ids), 1000):  # (one broadcast message per thousand)
        app.control.revoke(ids[at:at + 1000])
    runtime.room.lines.look_now(name)  # the dispatchers pass them on now
    return len(ids)


def rate_limit(app: Celery, name: str) -> Limit:
    """The rate limit ``name`` the app declares (the code's values)."""
    for known in select(app, (name,)):
        if isinstance(known.limit, Limit):
            return known.limit
    raise BadValue(f"limit {name!r} has no rate (a concurrency limit)", "NAME")


def _stopped_alone(app: Celery, name: str, value: object) -> list[Limit | Concurrency]:
    """Limit ``name`` as its stop's record has it, if no task of the app declares it (a
    gated client's): it is resumed from the record's rate."""
    if any(k.limit.name == name for k in known_limits(app)):
        return []
    gate = runtime_for(app).gate
    stop = parse(gate.client.hget(stops_key(gate.prefix), stop_field(name, value)))
    limit = stops.limit_of(stop, value) if stop is not None else None
    return [limit] if limit is not None else []


def _limits_of(app: Celery, name: str, value: object) -> list[Limit | Concurrency]:
    """The buckets of ``name`` (its rate and/or concurrency limit), for key ``value``."""
    found = []
    for known in select(app, (name,)):
        if known.keyed and value is None:
            raise NeedsKey(f"limit {name!r} is per key: give --key or --int-key")
        found.append(dataclasses.replace(known.limit, key=value if known.keyed else None))
    return found
