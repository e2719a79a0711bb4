"""The tests' databases on the test server: six of their own for each test process.

The suite runs in two processes (pytest-xdist names them gw0 and gw1 in
``PYTEST_XDIST_WORKER``, which the worker nodes they start inherit; a serial
run is gw0).  Each process starts a Redis server of its own, unless
``REDIS_URL`` names one they then share: so each takes databases of its own
(gw0 10-15, gw1 4-9), high numbers, since the tests flush them.  The server
URL's own database (0 by default) holds the gates' keys, under a key prefix
of each test's own.
"""

from __future__ import annotations

import os

_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_INDEX = int(_PROCESS.removeprefix("gw"))
if not 0 <= _INDEX <= 1:
    raise RuntimeError(f"test process {_PROCESS!r}: the suite runs in at most 2 processes "
                       "(each takes 6 of a shared server's 16 databases)")

#: The test app's broker (unless CT_BROKER names another), the throttle's store, the
#: result backend and the tasks' start records; the unit tests' apps' broker (never
#: consumed: keys under each test's prefix); the unit tests' own queues and results.
BROKER, STORE, RESULTS, RECORDS, UNIT, SCRATCH = (10 - 6 * _INDEX + k for k in range(6))
