"""The delay ladder's routing (``room/ladder.py``): which rung a delay starts on, the headers
that carry it down, and the queue it comes back to."""

from __future__ import annotations

from typing import Any

import pytest

from celery_throttle.room.ladder import (
    DELIVERY,
    MAX_DELAY_MS,
    TO_HEADER,
    origin,
    rung_headers,
    rung_name,
    strip,
    target,
)


def _waits(headers: dict[str, str]) -> int:
    """The milliseconds a message with ``headers`` waits: 2**k on each rung whose bit is 1."""
    return sum(2**int(name.rsplit("d", 1)[1]) for name, bit in headers.items() if bit == "1")


@pytest.mark.parametrize("delay_ms", [1, 2, 3, 250, 1000, 1023, 1024, 900_000, MAX_DELAY_MS])
def test_a_delay_starts_on_the_rung_of_its_highest_bit_and_waits_it_exactly(
        delay_ms: int) -> None:
    exchange, headers = rung_headers(delay_ms)
    top = delay_ms.bit_length() - 1
    assert exchange == rung_name(top)
    # One header per rung from the top one down, so every exchange on the way routes it.
    assert sorted(headers) == sorted(f"celery_throttle_d{k}" for k in range(top + 1))
    assert headers[f"celery_throttle_d{top}"] == "1"
    assert _waits(headers) == delay_ms


def test_no_delay_goes_straight_to_the_delivery() -> None:
    assert rung_headers(0) == (DELIVERY, {})


@pytest.mark.parametrize("delay_ms", [-1, MAX_DELAY_MS + 1])
def test_a_delay_off_the_ladder_is_refused_by_its_value(delay_ms: int) -> None:
    with pytest.raises(ValueError, match=f"a delay of {delay_ms} ms is not within"):
        rung_headers(delay_ms)


def test_a_message_goes_back_to_its_exchange_or_to_the_queue_its_key_names() -> None:
    assert target("celery", "celery") == "x:celery"  # routed there again by its key
    # The default exchange cannot be bound to: the queue it would route to (a lane's copies).
    assert target("", "celery.dispatched") == "q:celery.dispatched"


def test_a_copy_leaves_its_last_trip_s_headers_behind() -> None:
    headers = {"id": "t1", "celery_throttle": {"copy": "c"}, TO_HEADER: "x:celery",
               **rung_headers(5)[1], "x-death": [{"queue": "celery_throttle.delay.2"}],
               "x-first-death-queue": "celery_throttle.delay.2"}
    assert strip(headers) == {"id": "t1", "celery_throttle": {"copy": "c"}}


def test_a_copy_that_came_down_the_ladder_goes_back_to_its_first_exchange() -> None:
    """Dead-lettering delivers it from the ladder's exchange: its header says where to."""
    assert origin("celery_throttle.delay.out", {TO_HEADER: "x:celery"}) == "celery"
    assert origin("celery_throttle.delay.3", {TO_HEADER: "q:celery.dispatched"}) == ""
    assert origin("celery", {TO_HEADER: "x:other"}) == "celery"  # not from the ladder


def test_a_queue_bound_before_a_broker_lost_it_is_bound_again_on_a_new_connection(
        rabbitmq_url: str) -> None:
    """A transient lane bound to the ladder, then gone with its binding (what a broker's
    restart leaves of a non-durable queue): on the next connection the lane is declared
    again by its worker, and a copy sent down the ladder is bound to it again and arrives.
    Bound once per process, it was dropped, the publish confirmed all the same."""
    import secrets
    import time

    from kombu import Connection, Queue

    from celery_throttle.room.envelope import Envelope
    from celery_throttle.room.ladder import Ladder

    ladder = Ladder()
    lane = f"ladder-test-{secrets.token_hex(4)}.dispatched"
    to = target("", lane)
    channel: Any
    with Connection(rabbitmq_url) as first:
        channel = first.channel()
        Queue(lane, durable=False, routing_key=lane)(channel).declare()
        ladder.ready(channel, to)
        channel.queue_delete(lane)  # (gone, and its binding with it)
    with Connection(rabbitmq_url, transport_options={"confirm_publish": True}) as second:
        channel = second.channel()
        Queue(lane, durable=False, routing_key=lane)(channel).declare()  # (its worker's)
        envelope = Envelope(b'{"x": 1}', "application/json", "utf-8", "", lane,
                            {"id": "t-1", "task": "t"}, {})
        ladder.send(second.Producer(channel), envelope, 0.005, {})
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            got = channel.basic_get(lane, no_ack=True)
            if got is None:
                time.sleep(0.05)
        channel.queue_delete(lane)
    assert got is not None, "the copy never reached the lane"
    assert got.headers["id"] == "t-1"
