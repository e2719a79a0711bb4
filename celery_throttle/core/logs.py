"""The package's logger, and the pace of a warning that could repeat for every task.

Levels: INFO for a deferral (normal operation), WARNING for a degraded store,
ERROR only for a task that failed.  Key values and credentials are never
logged (key values are hashed before they reach Redis, see ``keys.py``).
"""

from __future__ import annotations

import logging
import time

__all__ = ["OUTAGE_EVERY", "Every", "logger"]

logger = logging.getLogger("celery_throttle")

#: Seconds between two reports of one ongoing outage (store or broker down).
OUTAGE_EVERY = 30.0


class Every:
    """Whether to report something now: at most once per ``seconds``, not once per task.

    Hundreds of tasks may be deferred per second while the store is down; one
    line per ``seconds`` per process (and app, or dispatcher) says it.
    """

    def __init__(self, seconds: float = OUTAGE_EVERY) -> None:
        self.seconds = seconds
        self._last = -seconds

    def due(self) -> bool:
        """True at most once per ``seconds`` (a racing thread costs one extra line)."""
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True
