"""Key names: a limit's keys never collide with another limit's, nor with the package's own."""

from __future__ import annotations

import redis
from hypothesis import given
from hypothesis import strategies as st

from celery_throttle import Concurrency, Gate, Limit, parse_rate
from celery_throttle.core.keys import (
    bell_key,
    bucket_key,
    copy_key,
    epoch_key,
    freed_key,
    key_digest,
    leases_key,
    line_key,
    meta_key,
    seat_line_key,
    task_key,
)
from celery_throttle.room.keys import room_key
from celery_throttle.room.parking import WaitingRoom

# Limit names shaped like the package's own keys, or like another limit's.
LOOKALIKES = ["epoch", "bell", "freed", "room:parked", "room:messages", "room:claimed",
              "room:ready", "room:trip",
              "wait:x", "copy:x:0", "arrived:x", "trip", "api:leases", "api:meta",
              "api:waiters", f"api:k:{key_digest('acme')}", "b:-:api", "-:api"]
LIMIT_KEYS = [bucket_key, leases_key, meta_key, line_key, seat_line_key]
names = st.text(min_size=1, max_size=12).filter(str.strip)
key_values = st.one_of(st.none(), st.text(max_size=6), st.integers())


def test_a_limit_named_like_an_internal_key_leaves_them_alone(gate: Gate, client: redis.Redis,
                                                              prefix: str) -> None:
    """Limits named "epoch", "room:parked", "api:leases", ... write only their own keys:
    a booking made before them is still claimable and the waiting room still parks."""
    api = Limit("api", parse_rate("1/s"))
    assert gate.acquire_many([api]).allowed
    booked = gate.acquire_many([api], reserve=10)
    assert booked.reservation is not None
    for name in LOOKALIKES:
        lookalike: list[Limit | Concurrency] = [Limit(name, parse_rate("10/s")),
                                                Concurrency(name, 2)]
        assert gate.acquire_many(lookalike, holder="h").allowed
        assert gate.release(lookalike, "h") == 1
    claimed = gate.acquire_many([api], claim=booked.reservation, grace=0.05)
    assert claimed.early  # still this booking's start: not voided by a new epoch
    room = WaitingRoom(client, prefix)
    room.park("entry", b"{}", "task-1", delay_us=10_000_000)  # no WRONGTYPE
    assert room.state().parked == 1


@given(st.lists(st.tuples(st.sampled_from(range(len(LIMIT_KEYS))), names, key_values),
                unique=True, max_size=20))
def test_distinct_limits_never_share_a_key(limits: list[tuple[int, str, object]]) -> None:
    """Every (kind, name, key value) has a key of its own, whatever the name holds."""
    keys = {LIMIT_KEYS[kind]("p", name, key) for kind, name, key in limits}
    assert len(limits) == len(keys)


@given(names, key_values, st.text(min_size=1, max_size=12))
def test_no_limit_key_is_ever_an_internal_key(name: str, key: object, task_id: str) -> None:
    """A limit's keys and the prefix's own keys (epoch, room, notes, copies) never meet."""
    internal = {epoch_key("p"), copy_key("p", task_id, 0), bell_key("p"), freed_key("p"),
                *(room_key("p", part) for part in ("parked", "messages", "claimed", "ready",
                                                    "trip", "notes")),
                *(task_key("p", kind, task_id) for kind in ("wait", "arrived", "copy"))}
    assert {make("p", name, key) for make in LIMIT_KEYS} & internal == set()
