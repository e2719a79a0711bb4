"""The wait-state header (wait_state.py) a deferred task carries."""

from __future__ import annotations

from celery_throttle.room.header import HEADER, WaitState


def test_wait_state_ignores_malformed_headers() -> None:
    """A malformed or hostile header reads as 'no state', never crashes the task."""

    class Req:
        def __init__(self) -> None:
            self.headers = {HEADER: {"slot": "x", "deferrals": -3, "since": 1.5, "booked": None}}

    assert WaitState.from_request(Req()) == WaitState()
