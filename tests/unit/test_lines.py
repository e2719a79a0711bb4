"""The limits' lines on a real Redis: order by place, dispatch at the limit's pace, in line."""

from __future__ import annotations

import itertools
import time
from typing import cast

import pytest
import redis

from celery_throttle import Concurrency, Gate, Limit, parse_rate
from celery_throttle.core.keys import key_digest, learned_key
from celery_throttle.room.entries import entry_id
from celery_throttle.room.envelope import Envelope, split_record
from celery_throttle.room.lines import MAX_AHEAD_US, Lines
from celery_throttle.room.parking import WaitingRoom

TIMEOUT_US = 60_000_000


def _now_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def _serve_all(lines: Lines, *, within: float, want: int) -> list[tuple[str, str, float]]:
    """Serve until ``want`` tasks are out or ``within`` seconds pass: (entry, flag, time)."""
    out: list[tuple[str, str, float]] = []
    start = time.monotonic()
    while len(out) < want and time.monotonic() - start < within:
        wait, served = lines.serve_due(50, TIMEOUT_US)
        out += [(s.entry, s.flag, time.monotonic() - start) for s in served]
        if not served:
            time.sleep(min(0.01 if wait is None else wait, 0.05))
    return out


def test_tasks_leave_in_place_order_at_the_limits_pace(client: redis.Redis, prefix: str) -> None:
    """Six tasks in one line at 20/s leave lowest place first, one interval (50 ms) apart."""
    lines = Lines(client, prefix)
    limit = Limit("api", parse_rate("20/s"))
    now = _now_us(client)
    for i, place in enumerate([5, 3, 9, 1, 7, 2]):
        lines.enqueue(f"e{place}", b"m", f"t{i}", limits=[limit], blocking=limit,
                      place_us=now + place)
    out = _serve_all(lines, within=3.0, want=6)
    assert [e for e, _, _ in out] == ["e1", "e2", "e3", "e5", "e7", "e9"]
    assert {f for _, f, _ in out} == {"c"}
    gaps = [b - a for (_, _, a), (_, _, b) in itertools.pairwise(out)]
    assert sum(gaps) / len(gaps) >= 0.045  # the limit's pace, not all at once
    assert lines.waiting() == 0


def test_a_fresh_start_joins_the_line_of_a_limit_with_waiting_tasks(
        client: redis.Redis, prefix: str) -> None:
    """In line, a free limit with a line answers queued (naming it); without one, admits."""
    gate = Gate(client, prefix=prefix)
    lines = Lines(client, prefix)
    limit = Limit("api", parse_rate("10/s"), burst=5)
    assert gate.acquire_many([limit], in_line=True).allowed
    lines.enqueue("e1", b"m", "t1", limits=[limit], blocking=limit, place_us=_now_us(client))
    decision = gate.acquire_many([limit], in_line=True)
    assert decision.queued
    assert decision.limit == limit
    assert not decision.allowed
    assert 0.05 <= decision.retry_after <= 0.1 + 1e-6  # one task ahead at 10/s
    assert gate.acquire_many([limit]).allowed  # a caller not in line is not held back
    gate.close()


def test_a_task_blocked_by_its_other_limit_moves_to_that_line_keeping_its_place(
        client: redis.Redis, prefix: str) -> None:
    """A task of two limits whose second is busy waits in the second's line, ahead of later ones."""
    gate = Gate(client, prefix=prefix)
    lines = Lines(client, prefix)
    shared, tenant = Limit("shared", parse_rate("100/s")), Limit("tenant", parse_rate("2/s"))
    assert gate.acquire_many([tenant]).allowed  # the tenant's limit is busy for 0.5 s
    now = _now_us(client)
    lines.enqueue("early", b"m", "t1", limits=[shared, tenant], blocking=shared,
                  place_us=now)
    lines.enqueue("late", b"m", "t2", limits=[tenant], blocking=tenant, place_us=now + 10)
    _, served = lines.serve_due(50, TIMEOUT_US)
    assert served == []
    assert client.zrange(tenant.line_in(prefix), 0, -1) == [b"early", b"late"]
    out = _serve_all(lines, within=3.0, want=2)
    assert [e for e, _, _ in out] == ["early", "late"]
    gate.close()


def test_expired_revoked_and_timed_out_tasks_leave_uncharged(client: redis.Redis,
                                                             prefix: str) -> None:
    """Past its expiry or max_wait, or revoked, a task leaves at once without taking the limit."""
    gate = Gate(client, prefix=prefix)
    lines = Lines(client, prefix)
    limit = Limit("slow", parse_rate("1/m"))
    assert gate.acquire_many([limit]).allowed  # busy for a minute
    now = _now_us(client)
    lines.enqueue("gone", b"m", "t1", limits=[limit], blocking=limit, place_us=now,
                  expires_us=now - 1)
    lines.enqueue("late", b"m", "t2", limits=[limit], blocking=limit, place_us=now + 1,
                  deadline_us=now - 1)
    lines.enqueue("revoked", b"m", "t3", limits=[limit], blocking=limit, place_us=now + 2)
    lines.enqueue("waits", b"m", "t4", limits=[limit], blocking=limit, place_us=now + 3)
    wait, served = lines.serve_due(50, TIMEOUT_US, revoked=lambda task_id: task_id == "t3")
    assert [(s.entry, s.flag) for s in served] == [("revoked", "x"), ("gone", "x"),
                                                   ("late", "t")]
    assert wait is not None
    assert 55 < wait <= 60  # the next start of the limit
    assert lines.waiting() == 1
    gate.close()


def test_a_new_rate_applies_to_the_tasks_already_waiting(client: redis.Redis,
                                                         prefix: str) -> None:
    """Enqueued at 1/s, dispatched at 20/s once the code declares 20/s."""
    lines = Lines(client, prefix)
    old = Limit("api", parse_rate("1/s"))
    now = _now_us(client)
    for i in range(10):
        lines.enqueue(f"e{i}", b"m", f"t{i}", limits=[old], blocking=old, place_us=now + i)
    lines.declare([Limit("api", parse_rate("20/s"))])
    out = _serve_all(lines, within=3.0, want=10)
    assert len(out) == 10
    assert out[-1][2] < 1.5  # 9 intervals of 50 ms, not 9 s


def test_purge_drops_the_lines_and_frees_the_limit(client: redis.Redis, prefix: str) -> None:
    """After a purge nothing is left in line and a fresh start in line is admitted at once."""
    gate = Gate(client, prefix=prefix)
    room = WaitingRoom(client, prefix)
    limit = Limit("api", parse_rate("1/s"))
    now = _now_us(client)
    for i in range(20):
        message = Envelope(b"{}", "application/json", "utf-8", "", "celery",
                           {"id": f"t{i}"}).dumps()
        room.lines.enqueue(f"e{i}", message, f"t{i}", limits=[limit], blocking=limit,
                           place_us=now + i)
    assert sorted(room.purge()) == sorted(f"t{i}" for i in range(20))
    assert room.lines.waiting() == 0
    assert room.lines.serve_due(50, TIMEOUT_US) == (None, [])
    assert gate.acquire_many([limit], in_line=True).allowed
    gate.close()


def test_an_entry_waits_once_whatever_the_broker_delivers_again(client: redis.Redis,
                                                                prefix: str) -> None:
    """Enqueueing or parking an entry that already waits writes nothing and says so (0)."""
    room = WaitingRoom(client, prefix)
    limit = Limit("api", parse_rate("1/s"))
    now = _now_us(client)
    assert room.lines.enqueue("e", b"first", "t", limits=[limit], blocking=limit,
                              place_us=now) > 0
    assert room.lines.enqueue("e", b"again", "t", limits=[limit], blocking=limit,
                              place_us=now - 5) == 0
    assert room.park("e", b"again", "t", delay_us=1) == 0
    assert split_record(client.hget(room.messages, "e") or b"")[1] == b"first"
    assert client.zrange(limit.line_in(prefix), 0, -1, withscores=True) == [(b"e", now)]


def test_lines_count_every_key_value_and_estimate_the_drain(client: redis.Redis,
                                                           prefix: str) -> None:
    """A per-key limit's lines add up under its name, busiest key first (hashed), and
    drain as fast as the longest one at the given interval."""
    lines = Lines(client, prefix)
    now = _now_us(client)
    for key, count in (("acme", 6), ("initech", 2)):
        limit = Limit("tenant", parse_rate("2/s"), key=key)
        for i in range(count):
            lines.enqueue(f"{key}{i}", b"m", f"{key}-t{i}", limits=[limit], blocking=limit,
                          place_us=now + i)
    shared = Limit("shared", parse_rate("10/s"))
    lines.enqueue("s0", b"m", "s-t0", limits=[shared], blocking=shared, place_us=now)
    busiest = lines.busiest({"tenant": 500_000})
    assert [(line.name, line.waiting) for line in busiest] == [("tenant", 8), ("shared", 1)]
    assert busiest[0].top == ((key_digest("acme"), 6), (key_digest("initech"), 2))
    assert busiest[0].drains_in == 3.0  # six at 2/s
    assert busiest[1].top == (("-", 1),)
    assert busiest[1].drains_in is None  # its rate was not given


def _fair_order(client: redis.Redis, lines: Lines, batches: list[tuple[str, int]],
                weights: dict[str, dict[str, int]] | None = None) -> list[str]:
    """Enqueue each (tenant, count) batch in order on one fair 100/s limit; serve them all."""
    now = _now_us(client)
    total = 0
    for tenant, count in batches:
        limit = Limit("shared", parse_rate("100/s"), fair=tenant)
        for i in range(count):
            lines.enqueue(f"{tenant}{i:03d}", b"m", f"{tenant}-{i}", limits=[limit],
                          blocking=limit, place_us=now + total, weights=weights)
            total += 1
    return [e for e, _, _ in _serve_all(lines, within=5.0, want=total)]


def test_a_fair_limit_serves_its_values_in_turn(client: redis.Redis, prefix: str) -> None:
    """Behind 30 waiting tasks of tenant a, tenant b's 5 (enqueued later) alternate with
    a's from the front: all 5 within the first 10 dispatches."""
    order = _fair_order(client, Lines(client, prefix), [("a", 30), ("b", 5)])
    assert len(order) == 35
    assert [e for e in order if e.startswith("b")] == [f"b{i:03d}" for i in range(5)]
    assert max(order.index(f"b{i:03d}") for i in range(5)) < 10
    assert [e for e in order if e.startswith("a")] == [f"a{i:03d}" for i in range(30)]


def test_a_fair_value_weighted_two_is_served_twice_as_often(client: redis.Redis,
                                                           prefix: str) -> None:
    """Weight 2 for tenant a: of the first 15 dispatches, 10 are a's and 5 are b's."""
    weights = {"shared": {key_digest("a"): 2}}  # (as the setting stores them: digests)
    order = _fair_order(client, Lines(client, prefix), [("a", 20), ("b", 20)], weights)
    first = order[:15]
    assert sum(e.startswith("a") for e in first) == 10


def test_a_task_moving_to_a_fair_line_takes_its_values_turn(client: redis.Redis,
                                                            prefix: str) -> None:
    """A task blocked by its fair limit moves into that queue at its value's next turn."""
    gate = Gate(client, prefix=prefix)
    lines = Lines(client, prefix)
    own = Limit("own", parse_rate("100/s"))
    shared = Limit("shared2", parse_rate("2/s"), fair="b")
    assert gate.acquire_many([shared]).allowed  # busy for 0.5 s
    now = _now_us(client)
    for i in range(3):
        a = Limit("shared2", parse_rate("2/s"), fair="a")
        lines.enqueue(f"a{i}", b"m", f"a-{i}", limits=[a], blocking=a, place_us=now + i)
    lines.enqueue("b0", b"m", "b-0", limits=[own, shared], blocking=own, place_us=now + 9)
    lines.serve_due(50, TIMEOUT_US)  # b0 moves: shared blocks it
    # b's first turn comes right after a's first:
    assert client.zrange(shared.line_in(prefix), 0, -1) == [b"a0", b"b0", b"a1", b"a2"]
    gate.close()


def test_the_heads_of_the_lines_are_listed_with_their_places(client: redis.Redis,
                                                              prefix: str) -> None:
    """next_in_line: each queue's first tasks, places 0 first, one limit's or every limit's."""
    lines = Lines(client, prefix)
    api = Limit("api", parse_rate("1/s"))
    mail = Limit("mail", parse_rate("1/s"), key="acme")
    now = _now_us(client)
    for i in range(3):
        lines.enqueue(f"a{i}", b"A%d" % i, f"ta{i}", limits=[api], blocking=api,
                      place_us=now + i, due_us=now + 10_000_000)
        lines.enqueue(f"m{i}", b"M%d" % i, f"tm{i}", limits=[mail], blocking=mail,
                      place_us=now + i, due_us=now + 10_000_000)
    every = lines.next_in_line(4)
    assert sorted((t.entry, t.place) for t in every) == [("a0", 0), ("a1", 1), ("m0", 0),
                                                         ("m1", 1)]
    assert {t.entry: t.message for t in every}["m1"] == b"M1"
    only = lines.next_in_line(10, "mail")
    assert [(t.entry, t.limit, t.key_digest, t.place) for t in only] == [
        ("m0", "mail", key_digest("acme"), 0), ("m1", "mail", key_digest("acme"), 1),
        ("m2", "mail", key_digest("acme"), 2)]
    assert lines.next_in_line(5, "nothing") == []


def test_a_task_lined_up_on_arrival_joins_only_a_line_that_has_tasks(
        client: redis.Redis, prefix: str) -> None:
    """Behind tasks in line: nothing written while the line is empty and its limit admits a
    start within reach (-1, with that wait); behind one task, 1 ahead; the same entry
    again (a message delivered twice), -2 and nothing written."""
    lines = Lines(client, prefix)
    limit = Limit("api", parse_rate("10/s"))
    now = _now_us(client)
    assert lines.line_up("e0", b"m", "t0", limits=[limit], blocking=limit, place_us=now,
                         within_us=500_000) == (-1, 0)
    assert lines.waiting() == 0
    assert client.hlen(lines.messages) == 0
    lines.enqueue("e1", b"m", "t1", limits=[limit], blocking=limit, place_us=now)
    assert lines.line_up("e2", b"m", "t2", limits=[limit], blocking=limit, place_us=now + 1,
                         within_us=500_000) == (1, 0)
    assert lines.line_up("e2", b"m", "t2", limits=[limit], blocking=limit, place_us=now + 1,
                         within_us=500_000) == (-2, 0)
    assert lines.waiting() == 2
    out = _serve_all(lines, within=3.0, want=2)
    assert [e for e, _, _ in out] == ["e1", "e2"]


def test_a_task_lined_up_on_arrival_waits_in_an_empty_line_for_a_start_out_of_reach(
        client: redis.Redis, prefix: str) -> None:
    """The line empty, its limit's next start beyond reach (where a pool process would put
    the task in line): it waits in line, 0 ahead, due at that start, and the dispatch
    hands it out then; within reach, nothing is written and the reply says how far the
    start is."""
    lines = Lines(client, prefix)
    limit = Limit("slow", parse_rate("2/s"))
    gate = Gate(client, prefix=prefix)
    assert gate.acquire_many([limit]).allowed  # (the next start is 0.5 s away)
    now = _now_us(client)
    ahead, wait = lines.line_up("e0", b"m", "t0", limits=[limit], blocking=limit,
                                place_us=now, within_us=600_000)
    assert ahead == -1
    assert 400_000 < wait <= 500_000
    assert lines.waiting() == 0
    ahead, wait = lines.line_up("e1", b"m", "t1", limits=[limit], blocking=limit,
                                place_us=now, within_us=100_000)
    assert ahead == 0
    assert 400_000 < wait <= 500_000
    assert lines.waiting() == 1
    wait_s, served = lines.serve_due(50, TIMEOUT_US)
    assert served == []
    assert wait_s is not None
    assert 0.2 < wait_s <= 0.5
    out = _serve_all(lines, within=3.0, want=1)
    assert [e for e, _, _ in out] == ["e1"]


def test_a_revoked_task_leaves_at_once_from_behind_tasks_that_wait(client: redis.Redis,
                                                                  prefix: str) -> None:
    """Revoked while two tasks wait ahead of it for a busy limit: it leaves at the next look,
    uncharged, not when its turn comes; the others keep waiting."""
    gate = Gate(client, prefix=prefix)
    lines = Lines(client, prefix)
    limit = Limit("slow", parse_rate("1/m"))
    assert gate.acquire_many([limit]).allowed  # busy for a minute
    now = _now_us(client)
    for i, entry in enumerate(["first", "second", "revoked", "last"]):
        lines.enqueue(entry, b"m", f"t{i}", limits=[limit], blocking=limit, place_us=now + i)
    wait, served = lines.serve_due(50, TIMEOUT_US, revoked=lambda task_id: task_id == "t2")
    assert [(s.entry, s.flag) for s in served] == [("revoked", "x")]
    assert wait is not None
    assert 55 < wait <= 60
    assert [t.entry for t in lines.next_in_line(10, "slow")] == ["first", "second", "last"]
    gate.close()


def test_revoked_tasks_leave_from_deep_in_line_and_parked_at_once(client: redis.Redis,
                                                                  prefix: str) -> None:
    """``WaitingRoom.cancel``: revoked tasks found by their ids leave at once, however deep
    in line (uncharged: the limit's next start stays where it was), or become due when
    parked; a copy in line is found through its note; others stay, unknown ids are
    ignored."""
    gate = Gate(client, prefix=prefix)
    room = WaitingRoom(client, prefix)
    limit = Limit("slow", parse_rate("1/m"))
    assert gate.acquire_many([limit]).allowed  # busy for a minute
    now = _now_us(client)
    ids = [f"t{i}" for i in range(30)]
    for i, task_id in enumerate(ids):
        room.lines.enqueue(entry_id(task_id), b"m", task_id, limits=[limit],
                           blocking=limit, place_us=now + i)
    # A copy in line (its entry named by another copy) and a parked task.
    room.lines.enqueue(entry_id("copied", "c1"), b"m", "copied", limits=[limit],
                       blocking=limit, place_us=now + 100)
    room.park(entry_id("parked"), b"p", "parked", delay_us=60_000_000)
    served, parked = room.cancel(["t25", "t3", "copied", "parked", "nowhere"], TIMEOUT_US)
    assert sorted(s.entry for s in served) == sorted(
        [entry_id("t25"), entry_id("t3"), entry_id("copied", "c1")])
    assert {s.flag for s in served} == {"x"}
    assert {s.message for s in served} == {b"m"}  # the message, not the record
    assert parked == 1
    _, due = room.take_due(10, TIMEOUT_US)
    assert [p.entry for p in due] == [entry_id("parked")]
    left = [t.entry for t in room.lines.next_in_line(40, "slow")]
    assert left == [entry_id(t) for t in ids if t not in ("t3", "t25")]
    # Nothing was charged: the limit still admits its next start in about a minute.
    assert 55 < gate.acquire_many([limit]).retry_after <= 60
    assert room.cancel(["t3", "copied"], TIMEOUT_US) == ([], 0)  # (gone already)
    gate.close()


def _seat_held(client: redis.Redis, prefix: str
               ) -> tuple[Gate, Lines, Concurrency, Limit, int]:
    """A concurrency=1 limit whose seat "running" holds, a fast rate limit beside it, and
    the server's time now."""
    gate = Gate(client, prefix=prefix)
    seat = Concurrency("llm", 1, lease=30)
    assert gate.acquire_many([seat], holder="running").allowed
    return gate, Lines(client, prefix), seat, Limit("api", parse_rate("100/s")), _now_us(client)


def test_a_seat_given_back_goes_to_the_first_in_the_seat_line(client: redis.Redis,
                                                               prefix: str) -> None:
    """concurrency=1 held: two tasks wait in the seat's line (the urgent one, placed first,
    arrived last); nothing leaves until the seat is given back, then the first takes it
    at once, in its own name, and the second waits for the next one."""
    gate, lines, seat, rate, now = _seat_held(client, prefix)
    lines.enqueue("batch", b"m", "t-batch", limits=[rate, seat], blocking=seat,
                  place_us=now + 1000)
    lines.enqueue("urgent", b"m", "t-urgent", limits=[rate, seat], blocking=seat,
                  place_us=now)
    wait, served = lines.serve_due(50, TIMEOUT_US)
    assert served == []
    assert wait is not None
    assert 25 < wait <= 30  # (the earliest lease's end: the fallback for a killed holder)
    assert gate.release([seat], "running") == 1
    wait, served = lines.serve_due(50, TIMEOUT_US)
    assert [(s.entry, s.flag) for s in served] == [("urgent", "c")]
    assert client.zscore(seat.key_in(prefix), "t-urgent") is not None  # its lease, taken
    assert client.zscore(seat.key_in(prefix), "running") is None
    assert [t.entry for t in lines.next_in_line(5, "llm")] == ["batch"]
    found = lines.find("batch")  # (`throttle why`: a turn per average run and seat)
    assert found is not None
    line, interval = found
    assert (line.limit, line.place) == ("llm", 0)
    assert 0 < interval < 5_000_000  # the one run given back so far: milliseconds
    assert gate.release([seat], "t-urgent") == 1
    out = _serve_all(lines, within=3.0, want=1)  # (at the rate limit's pace)
    assert [e for e, _, _ in out] == ["batch"]
    gate.close()


def test_a_task_whose_seat_is_full_at_its_turn_moves_to_the_seat_line_in_its_place(
        client: redis.Redis, prefix: str) -> None:
    """A task in a rate limit's line whose concurrency limit is full at its turn moves to
    the seat's line, ahead of a later one there, and charges nothing meanwhile; a fresh
    start is queued behind the seat's line unless it holds a seat already."""
    gate, lines, seat, rate, now = _seat_held(client, prefix)
    lines.enqueue("early", b"m", "t1", limits=[rate, seat], blocking=rate, place_us=now)
    lines.enqueue("late", b"m", "t2", limits=[rate, seat], blocking=seat, place_us=now + 10)
    _, served = lines.serve_due(50, TIMEOUT_US)
    assert served == []
    assert client.zrange(seat.line_in(prefix), 0, -1) == [b"early", b"late"]
    assert gate.inspect(rate).next_free == 0  # the rate limit was not charged
    fresh = gate.acquire_many([rate, seat], holder="fresh", in_line=True)
    assert fresh.queued
    assert fresh.limit == seat
    assert gate.acquire_many([rate, seat], holder="running", in_line=True).allowed
    gate.release([seat], "running")
    out = _serve_all(lines, within=3.0, want=1)
    assert [e for e, _, _ in out] == ["early"]
    gate.close()


def test_seats_whose_leases_end_soon_are_served_one_task_each(client: redis.Redis,
                                                              prefix: str) -> None:
    """concurrency=3, every seat held by a holder that stopped renewing, the three leases
    ending within the dispatch's lead: three tasks of the seat's line are served, one for
    each lease that ends, and the fourth waits for a seat as the others do."""
    gate = Gate(client, prefix=prefix)
    seats = Concurrency("llm", 3, lease=30)
    lines = Lines(client, prefix)
    now = _now_us(client)
    for holder in ("dead-1", "dead-2", "dead-3"):
        assert gate.acquire_many([seats], holder=holder).allowed
        client.zadd(seats.key_in(prefix), {holder: now + 200_000}, xx=True)
    for i in range(10):
        lines.enqueue(f"e{i}", b"m", f"t{i}", limits=[seats], blocking=seats,
                      place_us=now + i)
    _, served = lines.serve_due(50, TIMEOUT_US, lead_us=500_000)
    assert [s.entry for s in served] == ["e0", "e1", "e2"]
    leases = cast(list[tuple[bytes, float]],
                  client.zrange(seats.key_in(prefix), 0, -1, withscores=True))
    assert sorted(h for h, _ in leases) == [b"dead-1", b"dead-2", b"dead-3", b"t0", b"t1", b"t2"]
    # Until its copy arrives a served seat is held for the trip's allowance, not a lease.
    assert max(float(score) for _, score in leases) < now + 11_000_000
    gate.close()


def test_a_task_is_handed_out_ahead_of_its_start_by_the_lead_and_the_measured_trip(
        client: redis.Redis, prefix: str) -> None:
    """What a worker books at most while others wait in line: the dispatch's ahead, the lead
    plus the trip's average and two deviations, never beyond MAX_AHEAD_US."""
    lines = Lines(client, prefix)
    assert lines.ahead(5_000) == 0.005  # (no trip measured yet)
    client.hset(lines.trip, mapping={"avg": 40_000, "dev": 10_000})
    assert lines.ahead(6_000) == 0.066
    client.hset(lines.trip, mapping={"avg": 900_000, "dev": 0})
    assert lines.ahead(7_000) == MAX_AHEAD_US / 1e6


def test_tasks_in_line_leave_at_a_learned_rate_and_count_as_its_use(client: redis.Redis,
                                                                      prefix: str) -> None:
    """A limit that learns, declared at 20/s and cut twice (to 20 x 0.85 x 0.85 =
    14.45/s), serves its line at the learned pace, not the declared one; a set rate is its
    ceiling there too."""
    lines = Lines(client, prefix)
    limit = Limit("llm", parse_rate("20/s"), adaptive=True)
    lines.declare([limit])
    gate = Gate(client, prefix=prefix)
    gate.pause([limit], 0.0, refused_after=0.0)
    gate.pause([limit], 0.0, refused_after=0.0)
    learned = gate.inspect(limit).learned
    assert learned is not None
    assert learned.rate == pytest.approx(20 * 0.85 * 0.85, rel=1e-4)
    now = _now_us(client)
    for i in range(8):
        lines.enqueue(f"e{i}", b"m", f"t{i}", limits=[limit], blocking=limit,
                      place_us=now + i)
    out = _serve_all(lines, within=5.0, want=8)
    assert len(out) == 8
    gaps = [b - a for (_, _, a), (_, _, b) in itertools.pairwise(out)]
    assert sum(gaps) / len(gaps) >= 0.9 / learned.rate  # 69.2 ms, not 50 ms
    record = client.hgetall(learned_key(prefix, "llm"))
    assert int(record[b"n"]) > 0 or int(record[b"t"]) > 0  # (the dispatches were its use)
    client.hset(f"{{{prefix}}}:live", "llm", f"{parse_rate('5/s').interval_us} 1 5/s")
    for i in range(3):
        lines.enqueue(f"f{i}", b"m", f"u{i}", limits=[limit], blocking=limit,
                      place_us=now + 100 + i)
    out = _serve_all(lines, within=5.0, want=3)
    gaps = [b - a for (_, _, a), (_, _, b) in itertools.pairwise(out)]
    assert sum(gaps) / len(gaps) >= 0.18  # the set 5/s under the learned 14.45/s
