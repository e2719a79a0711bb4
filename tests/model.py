"""A pure-Python reference model of the gate, written from the definition, for property tests.

It keeps the buckets in a dict and decides exactly what decide.lua must decide;
the Lua script is compared with it over random arrival sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelLimit:
    """One bucket: key, emission interval (us), burst, cost."""

    key: str
    interval: int
    burst: int
    cost: int


@dataclass
class Model:
    """Theoretical arrival times by key; absent or past means empty."""

    tat: dict[str, int] = field(default_factory=dict)
    shift: dict[str, int] = field(default_factory=dict)  # how far late starts moved booked ones

    def earliest(self, now: int, lim: ModelLimit) -> int:
        """When ``lim`` next admits its cost: the start s with max(TAT, s) + cT - BT <= s."""
        return max(now, self.tat.get(lim.key, now) + (lim.cost - lim.burst) * lim.interval)

    def decide(
        self, now: int, limits: list[ModelLimit], horizon: int = -1,
        claim: tuple[int, frozenset[int], int] | None = None, grace: int = 0,
        near: int = 0,
    ) -> tuple[str, int, int, frozenset[int]]:
        """Return (status, wait_us, start_us, booked limit indexes).

        ``claim``: (its booked start, booked indexes, the shift it was booked at);
        ``near``: a booked start booked this close in every limit is allowed for itself.
        """
        starts = [self.earliest(now, lim) for lim in limits]
        if claim is not None:
            booked_start, booked, booked_shift = claim
            # Late starts since the booking moved the booked start later.
            due = booked_start + max(0, self._shift_of(limits, booked) - booked_shift)
            if now < due:
                if len(booked) == len(limits) and due - now <= grace:
                    # admitted for its booked start
                    return ("allowed", due - now, booked_start, booked)
                return ("early", due - now, booked_start, booked)
            others = [i for i in range(len(limits)) if i not in booked]
            if now <= due + grace:
                busy = max([starts[i] - now for i in others], default=0)
                if busy == 0:
                    self._charge(now, [limits[i] for i in others])
                    self._push(now, [limits[i] for i in sorted(booked)], now - due)
                    return ("allowed", 0, booked_start, booked)
                if now + busy <= due + grace:  # free within the grace: booked there too
                    start = now + busy
                    self._push(now, [limits[i] for i in sorted(booked)], start - due)
                    self._charge(start, [limits[i] for i in others])
                    return ("early", busy, start, booked | frozenset(others))
        start = max(starts)
        wait = start - now
        if wait == 0:
            self._charge(now, limits)
            return ("allowed", 0, 0, frozenset())
        if 0 <= horizon and wait <= horizon:
            # A limit free more than one start of its own before the booked start is
            # not booked: that would block its other users until the booked start.
            booked = frozenset(i for i, (s, lim) in enumerate(zip(starts, limits, strict=True))
                               if start - s <= lim.cost * lim.interval)
            self._charge(start, [limits[i] for i in sorted(booked)])
            if wait <= near and len(booked) == len(limits):
                return ("allowed", wait, start, booked)
            return ("reserved", wait, start, booked)
        return ("denied", wait, 0, frozenset())

    def _shift_of(self, limits: list[ModelLimit], booked: frozenset[int]) -> int:
        return sum(self.shift.get(limits[i].key, 0) for i in booked)

    def _push(self, now: int, limits: list[ModelLimit], by: int) -> None:
        """A start ``by`` late: the later booked starts of its booked limits move as much."""
        if by <= 0:
            return
        for lim in limits:
            self.shift[lim.key] = self.shift.get(lim.key, 0) + by
            self.tat[lim.key] = max(self.tat.get(lim.key, 0) + by, now + lim.cost * lim.interval)

    def _charge(self, at: int, limits: list[ModelLimit]) -> None:
        for lim in limits:
            self.tat[lim.key] = max(self.tat.get(lim.key, at), at) + lim.cost * lim.interval
