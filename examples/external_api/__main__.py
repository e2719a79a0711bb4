"""Run the example: ``python -m examples.external_api``.

Two worker nodes consume the ``partner-api`` queue; 20 contact syncs and 10
invoice syncs (two different, undecorated tasks) share its 5/s limit.
Expect: about 6 s, and never more than 5 starts in any 1 s window (+1 jitter).
"""

from __future__ import annotations

import sys

from celery_throttle.testing import max_in_window
from examples.common import stack, wait_for


def main() -> int:
    """Send the tasks and print the achieved rate and the worst window."""
    with stack("examples.external_api.app", queues=("partner-api",), env_prefix="EXT"):
        from examples.external_api.app import app, sync_contact, sync_invoice

        results = [sync_contact.delay(i) for i in range(20)]
        results += [sync_invoice.delay(i) for i in range(10)]
        wait_for({"sync_contact": results[:20], "sync_invoice": results[20:]}, timeout=60)
        starts = sorted(r.get(timeout=5) for r in results)
        app.close()
    span = starts[-1] - starts[0]
    worst = max_in_window(starts, 1.0)
    print(f"30 tasks in {span:.1f}s: {(len(starts) - 1) / span:.2f}/s against a limit of 5/s; "
          f"most starts in any 1 s window: {worst}")
    return 0 if worst <= 6 and (len(starts) - 1) / span >= 4.5 else 1


if __name__ == "__main__":
    sys.exit(main())
