"""A pure-Python reference model of the gate, written from the definition, for property tests.

It keeps the buckets in a dict and decides exactly what gate.lua must decide;
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

    def earliest(self, now: int, lim: ModelLimit) -> int:
        """When ``lim`` next admits its cost: the start s with max(TAT, s) + cT - BT <= s."""
        return max(now, self.tat.get(lim.key, now) + (lim.cost - lim.burst) * lim.interval)

    def decide(
        self, now: int, limits: list[ModelLimit], horizon: int = -1,
        claim: tuple[int, frozenset[int]] | None = None, grace: int = 0,
    ) -> tuple[str, int, int, frozenset[int]]:
        """Return (status, wait_us, slot_us, booked limit indexes)."""
        starts = [self.earliest(now, lim) for lim in limits]
        if claim is not None:
            slot, booked = claim
            if now < slot:
                return ("early", slot - now, slot, booked)
            others = [i for i in range(len(limits)) if i not in booked]
            if now <= slot + grace:
                busy = max([starts[i] - now for i in others], default=0)
                if busy == 0:
                    self._charge(now, [limits[i] for i in others])
                    return ("allowed", 0, slot, booked)
                if now + busy <= slot + grace:  # free within the grace: booked there too
                    self._charge(now + busy, [limits[i] for i in others])
                    return ("early", busy, slot, booked | frozenset(others))
        start = max(starts)
        wait = start - now
        if wait == 0:
            self._charge(now, limits)
            return ("allowed", 0, 0, frozenset())
        if 0 <= horizon and wait <= horizon:
            # A limit free more than one start of its own before the slot is
            # not booked: that would block its other users until the slot.
            booked = frozenset(i for i, (s, lim) in enumerate(zip(starts, limits, strict=True))
                               if start - s <= lim.cost * lim.interval)
            self._charge(start, [limits[i] for i in sorted(booked)])
            return ("reserved", wait, start, booked)
        return ("denied", wait, 0, frozenset())

    def _charge(self, at: int, limits: list[ModelLimit]) -> None:
        for lim in limits:
            self.tat[lim.key] = max(self.tat.get(lim.key, at), at) + lim.cost * lim.interval
