"""The limits that learn their rate and that no task may declare: one record per name.

A gated client's limit can learn its rate (``Limit(adaptive=True)``) with no
task of any app declaring it, so ``celery throttle status`` could not find it
(it finds limits by the app's declarations, never by scanning keys).  The
client writes its learning limits once, at its first request, to one hash
per prefix, ``{<prefix>}:learners`` (field: the limit's name; value: its rate,
burst, floor and whether it is per key), which status reads to show them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..values import text
from .keys import learners_key
from .limits import AnyLimit, Limit
from .rates import parse_rate

__all__ = ["fields", "limits", "read"]


def fields(limits: Iterable[AnyLimit]) -> dict[str, str]:
    """The records of the limits among ``limits`` that learn: name -> "rate burst floor
    per_key" (floor "-": the default, ``limits.FLOOR_SHARE``)."""
    return {lim.name: " ".join((lim.rate.text, str(lim.burst),
                                lim.floor.text if lim.floor is not None else "-",
                                "1" if lim.key is not None else "0"))
            for lim in limits if isinstance(lim, Limit) and lim.adaptive}


def limits(records: Mapping[bytes | str, bytes | str], key: object = None
           ) -> list[tuple[Limit, bool]]:
    """The limits the records say, for key value ``key`` of the per-key ones: (limit, per
    key); unreadable records are left out."""
    found = []
    for name, raw in records.items():
        try:
            rate, burst, floor, per_key = text(raw).split()
            lim = Limit(text(name), parse_rate(rate), int(burst),
                        key if per_key == "1" else None, adaptive=True,
                        floor=None if floor == "-" else parse_rate(floor))
        except (ValueError, TypeError):
            continue
        found.append((lim, per_key == "1"))
    return found


def read(client: Any, prefix: str, key: object = None) -> list[tuple[Limit, bool]]:
    """The learning limits gated clients wrote under ``prefix`` (:func:`limits`), read with
    ``client`` (a sync redis-py client)."""
    return limits(client.hgetall(learners_key(prefix)), key)
