"""Redis memory of one task waiting in line, by structure (no workers: the store alone).

    python -m benchmarks.room_memory [--n 20000]

``--n`` tasks of a small Celery task (one int argument) are put in line for
one limit through ``WaitingRoom.enqueue``, as a worker puts them, with the
message a worker stores.  Four layouts side by side on one fresh server:
this version's (one record per task: what the dispatch needs of it and its
message, deflated with its dictionary, in one field; no note, since
``celery throttle why`` finds the record from the task id), the one before
(the record in an entries hash of its own, the note a pointer to it), the
one before that (the note as JSON, a field of the notes hash) and the first
one (the message as JSON, the note a key of its own with a TTL); the older
ones are written here as those versions wrote them.  Prints a markdown
table: bytes per waiting task in total (``used_memory`` before and after)
and per structure (``MEMORY USAGE``).
"""

from __future__ import annotations

import argparse
import base64
import json
import secrets
import uuid
from typing import Any

import redis
from celery import Celery

from celery_throttle.core.keys import key_digest, task_key
from celery_throttle.core.limits import Limit
from celery_throttle.core.rates import parse_rate
from celery_throttle.room.entries import entry_id
from celery_throttle.room.envelope import Envelope, capture, split_record
from celery_throttle.room.keys import room_key
from celery_throttle.room.parking import WaitingRoom
from celery_throttle.testing import RedisServer

T0 = 1_796_000_000_000_000  # a fixed place in line (us): the memory does not depend on it
#: Where the earlier layouts kept each task's record (this version keeps none there).
ENTRIES = room_key("throttle", "entries")


def _message(app: Celery, task_id: str) -> Envelope:
    """What a worker stores for a small task it defers (Celery's headers and ours)."""
    task = app.tasks["proj.tasks.summarize"]
    header: dict[str, Any] = {"celery_throttle": {
        "slot": None, "booked": 0, "epoch": 0, "shift": 0, "deferrals": 1, "since": T0,
        "copy": secrets.token_hex(8), "prev": "", "spacing": [200000],
        "entry": f"{key_digest(task_id)}:-"}}
    return capture(task.signature((7,), task_id=task_id, priority=9, headers=header))


def _json_format(envelope: Envelope) -> bytes:
    """The stored format before this version: the fields as JSON, the body base64."""
    return json.dumps({
        "b": base64.b64encode(envelope.body).decode(), "ct": envelope.content_type,
        "ce": envelope.content_encoding, "x": envelope.exchange, "rk": envelope.routing_key,
        "h": envelope.headers, "p": envelope.properties}, separators=(",", ":")).encode()


def run(n: int, layout: str) -> dict[str, float]:
    """Bytes per waiting task, total and per structure, for ``layout`` ("now", "pointer",
    "note field" or "first")."""
    app = Celery("bench", broker="memory://", set_as_current=False)

    @app.task(name="proj.tasks.summarize", shared=False)
    def summarize(document: int) -> int:
        return document

    limit = Limit("proj.tasks.summarize", parse_rate("300/m"))
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        room = WaitingRoom(client, "throttle")
        base = int(client.info("memory")["used_memory"])
        for i in range(n):
            task_id = str(uuid.uuid4())
            entry = entry_id(task_id)
            envelope = _message(app, task_id)
            note: dict[str, Any] = {"task": summarize.name, "limit": limit.name, "due": T0 + i,
                                    "deferrals": 1, "since": T0,
                                    "queue": limit.line_in("throttle").decode(), "entry": entry}
            if layout != "first":
                room.enqueue(entry, envelope.dumps(), task_id, limits=[limit], blocking=limit,
                             place_us=T0 + i, due_us=T0 + 10**12)
                if layout == "note field":
                    client.hset(room.notes, key_digest(task_id),
                                json.dumps(note, separators=(",", ":")))
                elif layout == "pointer":
                    client.hset(room.notes, key_digest(task_id), f"@{entry}")
            else:
                room.enqueue(entry, _json_format(envelope), task_id, limits=[limit],
                             blocking=limit, place_us=T0 + i, due_us=T0 + 10**12)
                client.hdel(room.notes, key_digest(task_id))  # (that version wrote none)
                old = {**note, "booked": False, "parked_until": 0}
                client.set(task_key("throttle", "wait", task_id), json.dumps(old), px=3_600_000)
            if layout != "now":
                # The earlier versions kept the record in the entries hash, the
                # message alone in the messages hash.
                message = split_record(client.hget(room.messages, entry) or b"")[1]
                client.hset(room.messages, entry, message)
                # Its rows had the limit's name second, and its place.
                row: list[str | int] = [limit.key_in("throttle").decode(), limit.name,
                                        limit.rate.interval_us, limit.burst, limit.cost]
                if layout == "pointer":
                    earlier: dict[str, object] = {"t": task_id, "p": T0 + i, "l": [row]}
                else:  # (and every field, with its defaults)
                    earlier = {"t": task_id, "p": T0 + i, "e": 0, "w": 0, "l": [[*row, "", 1]]}
                client.hset(ENTRIES, entry,
                            json.dumps(earlier, separators=(",", ":")))
        total = int(client.info("memory")["used_memory"]) - base
        parts = {"messages": room.messages, "entries": ENTRIES,
                 "queue": limit.line_in("throttle").decode(), "notes hash": room.notes}
        out = {"total": total / n}
        for name, key in parts.items():
            out[name] = (client.memory_usage(key, samples=0) or 0) / n
        # The rest: the note keys of the first layout (a key, its value, its TTL).
        out["note keys"] = out["total"] - sum(out[name] for name in parts)
        client.close()
    app.close()
    return out


#: Each layout's column heading.
_HEADINGS = {"first": "JSON message, note key",
             "note field": "deflated message, note in the notes hash",
             "pointer": "the note a pointer to the entry",
             "now": "now: one record per task, no note"}


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="tasks in line")
    parser.add_argument("--only", choices=sorted(_HEADINGS), default=None,
                        help="measure this layout alone (a large --n takes minutes per layout)")
    args = parser.parse_args(argv)
    layouts = [args.only] if args.only else list(_HEADINGS)
    runs = [run(args.n, layout) for layout in layouts]
    only = f" --only {args.only}" if args.only else ""
    print(f"{args.n} tasks of one small task in line for one limit; bytes of Redis per "
          f"waiting task (`python -m benchmarks.room_memory --n {args.n}{only}`).\n")
    print("| structure | " + " | ".join(_HEADINGS[layout] for layout in layouts) + " |")
    print("|---|" + "---:|" * len(layouts))
    for name in ("messages", "entries", "queue", "notes hash", "note keys", "total"):
        print(f"| {name} | " + " | ".join(f"{r[name]:.0f} B" for r in runs) + " |")
    scale = "for" if args.n == 1_000_000 else "projected for"
    print(f"| {scale} 1,000,000 waiting tasks | "
          + " | ".join(f"{r['total'] * 1e6 / 2**30:.2f} GiB" for r in runs) + " |")


if __name__ == "__main__":
    main()
