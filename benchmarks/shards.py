"""What one Redis Cluster shard carries: decisions per second on one prefix and on three.

    python -m benchmarks.shards [--seconds 5] [--procs 2]

Every key of a prefix shares its hash tag, so one prefix lives on one shard.
This starts a real 3-master cluster on 127.0.0.1 and runs ``--procs``
client processes (each a Gate on the cluster, plain decisions in a loop) for
``--seconds``: first all on one prefix (one shard), then each process on its
own prefix, the prefixes chosen on different shards.  It also reads each
shard's own CPU time per decision (``INFO commandstats``: EVALSHA's
usec_per_call), which bounds what one shard core can carry whatever the
clients: 1e6 / usec_per_call decisions per second.  Nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from typing import Any

from celery_throttle import Gate, Limit, parse_rate
from celery_throttle.core.keys import bucket_key
from tests.servers import Cluster, command

LIMIT = Limit("api", parse_rate("1000000/s"), 1000)  # never denies: the cost is the same


def _client(url: str, prefix: str, seconds: float, out: Any) -> None:
    gate = Gate.from_url(url, prefix=prefix)
    gate.acquire_many([LIMIT])  # slots cached, script loaded
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        gate.acquire_many([LIMIT])
        count += 1
    out.put(count)


def _run(url: str, prefixes: list[str], seconds: float) -> float:
    out: Any = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_client, args=(url, p, seconds, out))
             for p in prefixes]
    for p in procs:
        p.start()
    total = sum(int(out.get(timeout=seconds + 60)) for _ in procs)
    for p in procs:
        p.join(10)
    return total / seconds


def _usec_per_decision(cluster: Cluster) -> list[float]:
    found = []
    for node in range(len(cluster.nodes)):
        with contextlib.closing(cluster.client(node)) as cli:
            stats = cli.info("commandstats").get("cmdstat_evalsha")
            if stats and stats["calls"] > 1000:
                found.append(float(stats["usec_per_call"]))
    return found


def _reset_stats(cluster: Cluster) -> None:
    for node in range(len(cluster.nodes)):
        with contextlib.closing(cluster.client(node)) as cli:
            command(cli, "CONFIG", "RESETSTAT")


def _prefixes_on_shards(cluster: Cluster, count: int) -> list[str]:
    """``count`` prefixes whose slots are on ``count`` different shards."""
    chosen: dict[int, str] = {}
    with contextlib.closing(cluster.client(0)) as cli:
        for i in range(1000):
            prefix = f"shard{i}"
            slot = int(command(cli, "CLUSTER KEYSLOT", bucket_key(prefix, "api")))
            chosen.setdefault(cluster.owner(slot), prefix)
            if len(chosen) == count:
                break
    return list(chosen.values())


def table(seconds: float = 5.0, procs: int = 2) -> str:
    """Run both layouts on a fresh cluster; return a Markdown table."""
    with Cluster() as cluster:
        spread = _prefixes_on_shards(cluster, min(procs, 3))
        spread = (spread * procs)[:procs]
        _reset_stats(cluster)
        one = _run(cluster.url, [spread[0]] * procs, seconds)
        cpu_one = _usec_per_decision(cluster)
        _reset_stats(cluster)
        many = _run(cluster.url, spread, seconds)
        cpu_many = _usec_per_decision(cluster)
    cpu = min(cpu_one) if cpu_one else float("nan")
    rows = [
        "| layout | client processes | decisions/s (all clients) | shard CPU per decision |",
        "|---|---:|---:|---:|",
        f"| one prefix (one shard) | {procs} | {one:,.0f} | "
        f"{', '.join(f'{u:.1f} us' for u in cpu_one)} |",
        f"| one prefix per process ({len(set(spread))} shards) | {procs} | {many:,.0f} | "
        f"{', '.join(f'{u:.1f} us' for u in cpu_many)} |",
    ]
    return "\n".join(rows) + (f"\n\nOne shard core at {cpu:.1f} us per decision carries at "
                              f"most {1e6 / cpu:,.0f} decisions per second.")


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--procs", type=int, default=2)
    args = parser.parse_args()
    print(table(args.seconds, args.procs))


if __name__ == "__main__":
    main()
