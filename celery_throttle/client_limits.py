"""What a gated client is limited by: its rate limits and token limits, from its arguments.

``gated_client`` and ``async_gated_client`` (``transport.py``) take a rate
under a name, more limits, and token quotas as rates or limits; these are the
limits they make of them, checked before any client is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypedDict

from . import usage
from .core.limits import Limit
from .core.rates import Rate, parse_rate

__all__ = ["Meters", "TokenQuota", "limits_of", "meters", "token_limits"]


def limits_of(rate: str | Rate | None, name: str | None, burst: int, key: object,
               limits: Sequence[Limit], adaptive: bool = False,
               floor: str | Rate | None = None) -> list[Limit]:
    """The transport's limits: ``rate`` under ``name`` (learning its rate below it when
    ``adaptive``, not below ``floor``), and/or ``limits`` (rate limits only)."""
    chosen = list(limits)
    if rate is not None:
        if not name:
            raise ValueError("a rate needs the limit's name (name=...), the same as the "
                             "workers' @throttled(name=...) for one shared quota")
        chosen.insert(0, Limit(name, parse_rate(rate), burst, key, adaptive=adaptive,
                               floor=None if floor is None else parse_rate(floor)))
    elif adaptive or floor is not None:
        raise ValueError("adaptive and floor go with a rate (or with each Limit given)")
    elif name is not None and not limits:
        raise ValueError(f"limit {name!r} needs a rate")
    if not chosen:
        raise ValueError("give a rate (with name=...) or limits=[Limit(...), ...]")
    for lim in chosen:
        if not isinstance(lim, Limit):
            raise TypeError(f"a transport carries rate limits only, not {lim!r}: a request "
                            "ends when its response is read, which the transport does not see")
    return chosen


def meters(tokens: Limit | None, input_tokens: Limit | None,
            output_tokens: Limit | None) -> dict[str, Limit]:
    given = dict(zip(usage.PARTS, (tokens, input_tokens, output_tokens), strict=True))
    return {part: lim for part, lim in given.items() if lim is not None}


def _token_limit(given: str | Rate | Limit | None, name: str | None, part: str
                 ) -> Limit | None:
    """A token limit ``gated_client`` declares: a :class:`Limit` as given, or a rate under
    ``<name>-<part>`` with a whole period's tokens as its burst (a request may cost
    thousands)."""
    if given is None or isinstance(given, Limit):
        return given
    if not name:
        raise ValueError(f"a {part} rate needs name=... (the limit is '<name>-{part}'), "
                         f"or give a Limit")
    rate = parse_rate(given)
    return Limit(f"{name}-{part}", rate, max(1, math.ceil(rate.count)))


TokenQuota = str | Rate | Limit | None


class Meters(TypedDict):
    tokens: Limit | None
    input_tokens: Limit | None
    output_tokens: Limit | None


def token_limits(name: str | None, tokens: TokenQuota, input_tokens: TokenQuota,
                  output_tokens: TokenQuota) -> Meters:
    """The transports' token keyword arguments, from what a ``gated_client`` was given."""
    return {"tokens": _token_limit(tokens, name, "tokens"),
            "input_tokens": _token_limit(input_tokens, name, "input-tokens"),
            "output_tokens": _token_limit(output_tokens, name, "output-tokens")}
