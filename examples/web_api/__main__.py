"""Run the example: ``python -m examples.web_api``.

One quota, two kinds of callers: a Starlette app served by uvicorn (its
endpoint waits with ``AsyncGate.admitted``) and a Celery worker node (its task
is ``@throttled``), both under limit "provider" at 8/s, in front of a mock
provider that allows 10 requests in any 1 s.  40 HTTP requests and 40 tasks
are sent at once.  Expect: every one done, 0 429s, the provider's worst 1 s
window at most 8 + 1 (a start's jitter), the combined rate near 8/s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from celery_throttle.testing import free_port, max_in_window
from examples.common import ROOT, stack

N_HTTP, N_TASKS = 40, 40


@contextlib.contextmanager
def web_server() -> Iterator[str]:
    """uvicorn serving examples.web_api.web:app on 127.0.0.1 (WEB_* from this process)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.web_api.web:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the web server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


def post(url: str, i: int) -> int:
    """One request to the web app; its HTTP status."""
    request = urllib.request.Request(f"{url}/summarize", method="POST",
                                     data=json.dumps({"doc": f"web document {i}"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status)


def main() -> int:
    """Send both kinds of calls at once; print progress, then what the provider saw."""
    with stack("examples.web_api.app", nodes=("node1",), env_prefix="WEB") as provider, \
            web_server() as url:
        from examples.web_api.app import app, summarize

        provider.reset()
        with concurrent.futures.ThreadPoolExecutor(max_workers=N_HTTP) as pool:
            requests = [pool.submit(post, url, i) for i in range(N_HTTP)]
            tasks = [summarize.delay(f"task document {i}") for i in range(N_TASKS)]
            deadline = time.monotonic() + 60
            started = time.monotonic()
            while time.monotonic() < deadline:
                done_http = sum(f.done() for f in requests)
                done_tasks = sum(r.ready() for r in tasks)
                print(f"{time.monotonic() - started:5.1f}s  web requests {done_http}/{N_HTTP}, "
                      f"tasks {done_tasks}/{N_TASKS}; provider calls {len(provider.accepted)}, "
                      f"429s {len(provider.refused)}", flush=True)
                if done_http == N_HTTP and done_tasks == N_TASKS:
                    break
                time.sleep(1.0)
            statuses = [f.result(timeout=5) for f in requests]
            [r.get(timeout=5) for r in tasks]
        app.close()
        accepted, refused = sorted(provider.accepted), list(provider.refused)
    span = accepted[-1] - accepted[0]
    rate = (len(accepted) - 1) / span
    # The pace once both kinds of callers are under way: after the first second's calls
    # (a web server's and a worker's first calls wait for their connections).
    steady = accepted[8:]
    pace = (len(steady) - 1) / (steady[-1] - steady[0])
    worst = max_in_window(accepted, 1.0)
    print(f"provider: {len(accepted)} calls ({N_HTTP} from the web app, {N_TASKS} from tasks) "
          f"in {span:.1f}s: {rate:.2f}/s ({pace:.2f}/s after the first second's calls) "
          f"against the shared limit of 8/s; most in any 1 s window: {worst} (quota 10); "
          f"429s: {len(refused)}; web answers: {sorted(set(statuses))}")
    ok = (not refused and worst <= 9 and pace >= 0.9 * 8 and statuses == [200] * N_HTTP
          and len(accepted) == N_HTTP + N_TASKS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
