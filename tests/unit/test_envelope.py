"""A captured message, published later by the dispatcher, is the message Celery would have sent."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_throttle.room.envelope import Envelope, capture


@pytest.mark.parametrize(("serializer", "compression"),
                         [("json", None), ("pickle", "zlib"), ("msgpack", None)])
def test_captured_message_is_published_unchanged(
    redis_base: str, serializer: str, compression: str | None
) -> None:
    """Body, serializer, compression, queue, priority and headers survive capture and publish."""
    broker = f"{redis_base}/9"
    app = Celery("envelope", broker=broker, set_as_current=False)
    app.conf.update(task_serializer=serializer, task_compression=compression,
                    accept_content=[serializer])

    @app.task(name="envelope.add", shared=False)
    def add(a: int, b: int = 2) -> int:
        return a + b

    options: dict[str, Any] = {"queue": "room-q", "priority": 3,
                               "headers": {"celery_throttle": {"entry": "e1"}}}
    signature = add.signature((1,), {"b": 3}, **options)
    envelope = Envelope.loads(capture(signature).dumps())
    with Connection(broker) as conn:
        queue = conn.SimpleQueue("room-q", accept=[serializer])
        queue.clear()
        envelope.with_header("celery_throttle", token="t1").publish(conn.Producer())
        message = queue.get(timeout=5)
        body = message.decode()
        headers = message.headers
        queue.close()
    app.close()
    assert body[0] == [1] or body[0] == (1,)
    assert body[1] == {"b": 3}
    assert headers["task"] == "envelope.add"
    assert headers["eta"] is None
    assert headers["celery_throttle"] == {"entry": "e1", "token": "t1"}
    assert message.properties["priority"] == 3
    assert message.content_type == {"json": "application/json",
                                    "pickle": "application/x-python-serialize",
                                    "msgpack": "application/x-msgpack"}[serializer]
