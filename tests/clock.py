"""A caller clock the tests move explicitly, for exact gate decisions without sleeping."""

from __future__ import annotations

T0 = 1_800_000_000_000_000  # an arbitrary fixed "now" in microseconds


class StepClock:
    """A caller clock the test moves explicitly (no sleeping to reach boundaries)."""

    def __init__(self, us: int = T0) -> None:
        self.us = us

    def __call__(self) -> float:
        return self.us / 1_000_000  # exactly representable for these magnitudes
