"""Run the example: ``python -m examples.llm_quota``.

Tenant "bigco" floods 40 calls; "smallco" and "indie" send 4 each a moment
later.  The mock provider allows 10 requests per second and 4 calls in
flight, and 5 s in it stops answering for 2 s (429, Retry-After: 2), as a
loaded provider does.  Expect: that one 429 (and at most the calls already
in flight with it), nothing sent to the provider while it said to wait, no
call retried, and the small tenants done in about 2 s instead of waiting
behind bigco's 20 s.
"""

from __future__ import annotations

import sys
import threading
import time

from examples.common import stack, wait_for

HOLD_AT, HOLD_FOR, IN_FLIGHT = 5.0, 2.0, 4


def main() -> int:
    """Send the calls, make the provider refuse once, print what each tenant saw."""
    with stack("examples.llm_quota.app", nodes=("node1",), env_prefix="LLM", concurrency=8,
               provider_options={"max_inflight": IN_FLIGHT}) as provider:
        from examples.llm_quota.app import summarize

        start = time.time()
        hold = threading.Timer(HOLD_AT, provider.hold, (HOLD_FOR,))
        hold.start()
        big = [summarize.delay("bigco", "quarterly report " * 20) for _ in range(40)]
        time.sleep(0.5)
        small = {t: [summarize.delay(t, "short note " * 5) for _ in range(4)]
                 for t in ("smallco", "indie")}
        print("progress: calls done per tenant", flush=True)
        waiting_from = time.time() - start
        finished = wait_for({"bigco": big, **small}, timeout=60,
                            extra=lambda: f"provider 429s {len(provider.refused)}")
        # Seconds from bigco's first send, as the summary reports them.
        done = {t: waiting_from + finished[t] for t in ("smallco", "indie", "bigco")}
        retried = sum(r.get(timeout=5)["retries"] for r in [*big, *small["smallco"],
                                                             *small["indie"]])
        hold.cancel()
        refused = sorted(provider.refused)
        # Sent after the first 429 came back (the calls already on their way
        # arrive within a moment of it): the provider refuses until its hold
        # ends, so a call sent while it said to wait is one more 429.
        sent_meanwhile = [t for t in refused if t > refused[0] + 0.25]
        summarize.app.close()
    print(f"{'tenant':8}  calls  finished after")
    for tenant, seconds in done.items():
        count = 40 if tenant == "bigco" else 4
        print(f"{tenant:8}  {count:5}  {seconds:5.1f}s")
    print(f"provider 429s: {len(refused)} (it refused for {HOLD_FOR:g} s from "
          f"{HOLD_AT:g} s in; calls sent while it said to wait: {len(sent_meanwhile)}); "
          f"most in flight: {provider.most_inflight} of {IN_FLIGHT}; calls retried: {retried}")
    # The point: small tenants are not queued behind bigco (about 2 s against
    # its 20 s); the margin absorbs a loaded CI machine's late starts.
    fair = max(done["smallco"], done["indie"]) < done["bigco"] / 3
    # The 429s are the first and at most the calls in flight with it, and
    # nothing was sent while the provider said to wait.
    paused = bool(refused) and len(refused) <= IN_FLIGHT and not sent_meanwhile
    return 0 if fair and paused and retried == 0 and provider.most_inflight <= IN_FLIGHT else 1


if __name__ == "__main__":
    sys.exit(main())
