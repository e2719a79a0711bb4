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

    def decide(
        self, now: int, limits: list[ModelLimit], horizon: int = -1
    ) -> tuple[str, int, int]:
        """Return (status, wait_us, slot_us) with status allowed/denied/reserved."""
        # The earliest time at which every limit admits its cost.
        earliest = now
        for lim in limits:
            tat = max(self.tat.get(lim.key, now), now)
            earliest = max(earliest, tat + lim.cost * lim.interval - lim.burst * lim.interval)
        wait = earliest - now
        if wait == 0:
            self._charge(now, limits)
            return ("allowed", 0, 0)
        if horizon >= 0 and wait <= horizon:
            self._charge(earliest, limits)
            return ("reserved", wait, earliest)
        return ("denied", wait, 0)

    def _charge(self, at: int, limits: list[ModelLimit]) -> None:
        for lim in limits:
            self.tat[lim.key] = max(self.tat.get(lim.key, at), at) + lim.cost * lim.interval

    def starts_in_window_bound(self, lim: ModelLimit, window_us: int) -> int:
        """The most units ``lim`` may admit in any window of ``window_us``: B - 1 + ceil(w/T)."""
        return lim.burst - 1 + -(-window_us // lim.interval)
