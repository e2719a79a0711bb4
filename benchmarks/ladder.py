"""How many waiting messages RabbitMQ's delay ladder carries on time.

    python -m benchmarks.ladder [--rates 20,50,100,200] [--seconds 10]

No workers: a RabbitMQ node of its own (the tests' ``RabbitMQ``), one
publisher and one consumer.  For each rate the publisher sends that many
messages a second for ``--seconds`` through the ladder (``room/ladder.py``),
each with a delay drawn from 5-15 s (a 10 s delay is 10,000 ms: 5 set bits,
so 5 passes through a rung's quorum queue), to a queue bound to the
ladder's delivery.  The consumer notes when each comes back.  Late: its
arrival minus its due time.  A rate the ladder cannot carry shows as
lateness that grows with the run, since every rung's queue hands its
messages on in order.  Nothing here asserts: the table is the result.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Producer, Queue

from celery_throttle.room.ladder import TO_HEADER, Ladder, rung_headers, target

ROOT = Path(__file__).resolve().parent.parent
_TARGET = "ladder-bench"
_DUE = "bench_due"


def _one_rate(url: str, rate: int, seconds: float, rng: random.Random) -> dict[str, Any]:
    """Send ``rate`` messages a second for ``seconds``; collect them; their lateness."""
    queue = Queue(f"{_TARGET}-{rate}", Exchange(""), routing_key=f"{_TARGET}-{rate}",
                  durable=True)
    late: list[float] = []
    passes: list[int] = []
    done = threading.Event()
    consuming = threading.Event()

    def on_message(body: Any, message: Any) -> None:
        late.append(time.time() - float(message.headers[_DUE]))
        message.ack()

    def consume() -> None:
        with Connection(url) as conn, conn.Consumer(queue, callbacks=[on_message],
                                                    prefetch_count=500):
            consuming.set()
            while not done.is_set():  # (bounded by the publisher's deadline below)
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    continue

    with Connection(url) as publish:
        channel = publish.channel()
        producer = Producer(channel)
        queue(channel).declare()
        ladder = Ladder()
        to = target("", queue.name)
        ladder.ready(channel, to)
        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        consuming.wait(30)
        sent = 0
        t0 = time.monotonic()
        last_due = 0.0
        # Paced in steps of 10 ms; bounded by the count.
        while sent < rate * seconds:
            due_count = int((time.monotonic() - t0) * rate) + 1
            while sent < min(due_count, rate * seconds):
                delay_ms = rng.randint(5_000, 15_000)
                exchange, bits = rung_headers(delay_ms)
                due = time.time() + delay_ms / 1000
                last_due = max(last_due, due)
                producer.publish(b"x", exchange=exchange, routing_key=queue.name,
                                 headers={**bits, TO_HEADER: to, _DUE: repr(due)},
                                 delivery_mode=2, retry=False)
                passes.append(bin(delay_ms).count("1"))
                sent += 1
            time.sleep(0.01)
        publish_took = time.monotonic() - t0
        # Until every message is back, or 120 s past the last due time.
        while len(late) < sent and time.time() < last_due + 120:
            time.sleep(0.2)
        done.set()
        reader.join(10)
        queue(channel).delete()
    late.sort()
    return {"rate": rate, "sent": sent, "back": len(late), "publish_s": publish_took,
            "passes": statistics.mean(passes) if passes else 0.0,
            "p50": late[len(late) // 2] if late else float("nan"),
            "p90": late[int(len(late) * 0.9)] if late else float("nan"),
            "max": late[-1] if late else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,50,100,200",
                        help="messages a second, comma-separated (one run each, in turn)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.servers import RabbitMQ, find_rabbitmq_server

    if find_rabbitmq_server() is None:
        print("(rabbitmq-server is not installed: the ladder has no broker to run on)")
        return 0
    rng = random.Random(args.seed)
    broker = RabbitMQ().start()
    try:
        rows = [_one_rate(broker.url, int(r), args.seconds, rng)
                for r in args.rates.split(",")]
    finally:
        broker.stop()
    print(f"\ndelays 5-15 s, {args.seconds:g} s of publishing per rate, seed {args.seed}\n")
    print("| rate, msg/s | sent | back | rung passes each (mean) | publishing took, s "
          "| late p50, s | p90, s | most, s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['rate']} | {row['sent']} | {row['back']} | {row['passes']:.1f} "
              f"| {row['publish_s']:.1f} | {row['p50']:.3f} | {row['p90']:.3f} "
              f"| {row['max']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
