"""The tests' databases on the test server: six of their own for each test process.

The suite runs in two processes (pytest-xdist names them gw0 and gw1 in
``PYTEST_XDIST_WORKER``, which the worker nodes they start inherit; a serial
run is gw0), each on a Redis server of its own; on one given by ``REDIS_URL``
it runs in one (``tests/conftest.py``), gw0, whose databases 10-15 (flushed
by the tests) are clear of the examples' 0-8; gw1's are 4-9.  The server
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
