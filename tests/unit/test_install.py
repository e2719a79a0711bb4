"""install(app) (worker.py): its signal receivers are connected by install, once per app."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_receivers_are_connected_by_install_once_per_app_and_none_at_import() -> None:
    """Importing the package connects no task_postrun or worker_init receiver; each installed
    app connects its own once (install is idempotent) and it ignores other apps' tasks."""
    script = textwrap.dedent('''
        from celery import Celery, signals
        import celery_throttle

        def ours(signal):
            return sum(1 for _, receiver in signal.receivers
                       if getattr(receiver, "__module__", "").startswith("celery_throttle"))

        counts = [(ours(signals.task_postrun), ours(signals.worker_init))]
        a = Celery("a", broker="redis://127.0.0.1:1/0", set_as_current=False)
        b = Celery("b", broker="redis://127.0.0.1:1/0", set_as_current=False)
        celery_throttle.install(a)
        counts.append((ours(signals.task_postrun), ours(signals.worker_init)))
        celery_throttle.install(a)
        celery_throttle.install(b)
        counts.append((ours(signals.task_postrun), ours(signals.worker_init)))

        @b.task(shared=False)
        def job():
            return 1

        # Each app's receiver acts on its own app's tasks only: b's task ends
        # one run, and the run-end handler is called once (b's), not twice.  A
        # run cut off by its process's exit (no state: SystemExit) has not ended.
        import celery_throttle.integration.install as worker
        ended = []
        worker.run_ended = ended.append
        signals.task_postrun.send(sender=job, task=job, task_id="x", args=(), kwargs={},
                                  state=None)
        signals.task_postrun.send(sender=job, task=job, task_id="x", args=(), kwargs={},
                                  state="SUCCESS")
        print(counts, len(ended))
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[(0, 0), (1, 1), (2, 2)] 1"
