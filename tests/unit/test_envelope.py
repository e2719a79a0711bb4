"""A captured message, published later by the dispatcher, is the message Celery would have sent."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_throttle.room.envelope import Envelope, capture

from .. import databases


@pytest.mark.parametrize(("serializer", "compression"),
                         [("json", None), ("pickle", "zlib"), ("msgpack", None)])
def test_captured_message_is_published_unchanged(
    redis_base: str, serializer: str, compression: str | None
) -> None:
    """Body, serializer, compression, queue, priority and headers survive capture and publish."""
    broker = f"{redis_base}/{databases.SCRATCH}"
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


def _small_message() -> Envelope:
    """What a worker stores for a small task it defers: Celery's headers and this package's."""
    app = Celery("envelope", broker="memory://", set_as_current=False)

    @app.task(name="proj.tasks.summarize", shared=False)
    def summarize(document: int) -> int:
        return document

    header: dict[str, Any] = {"celery_throttle": {"slot": None, "booked": 0, "epoch": 0, "shift": 0,
                                  "deferrals": 1, "since": 1_796_000_000_123_456,
                                  "copy": "5f0c2a9e41b7d3c8", "prev": "", "spacing": [200000],
                                  "entry": "0a9f3c5e7d1b2a4c:-"}}
    envelope = capture(summarize.signature((7,), priority=9, headers=header))
    app.close()
    return envelope


def test_a_stored_message_is_compressed_and_read_back_whole() -> None:
    """A small task's stored message is under a third of its JSON and reads back unchanged."""
    envelope = _small_message()
    stored = envelope.dumps()
    assert Envelope.loads(stored) == envelope
    assert Envelope.task_id_in(stored) == envelope.headers["id"]
    old = _old_format(envelope)
    # (The figures: BENCHMARKS.md, "Memory of a task waiting in line".)
    print(f"\nstored message: {len(stored)} B; JSON {len(old)} B")
    assert len(stored) * 3 < len(old)


def _old_format(envelope: Envelope) -> bytes:
    return json.dumps({
        "b": base64.b64encode(envelope.body).decode(), "ct": envelope.content_type,
        "ce": envelope.content_encoding, "x": envelope.exchange, "rk": envelope.routing_key,
        "h": envelope.headers, "p": envelope.properties}, separators=(",", ":")).encode()


@pytest.mark.parametrize("raw", [b"", b"\x02abc", b"\x01not deflate", b"[1, 2]", b"{broken"])
def test_what_is_not_a_stored_message_is_refused_by_name(raw: bytes) -> None:
    """Anything else (plain JSON included) is a ValueError saying so, and has no task id."""
    with pytest.raises(ValueError, match=r"not a stored envelope|Expecting"):
        Envelope.loads(raw)
    assert Envelope.task_id_in(raw) == ""


@pytest.mark.parametrize("ignore_result", [False, True])
def test_a_capture_keeps_ignore_result_and_subscribes_to_no_result(
    redis_base: str, ignore_result: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message says what the signature says of its result; the capture itself asks the
    result backend for nothing (where tasks may wait for results, Celery would subscribe to
    the result of a message that is never sent)."""
    from celery import _state

    app = Celery("envelope", broker="memory://", backend=f"{redis_base}/{databases.SCRATCH}",
                 set_as_current=False)

    @app.task(name="envelope.keep", shared=False)
    def keep(a: int) -> int:
        return a

    # As in a gevent, eventlet or threads pool: joining a result would not block.
    monkeypatch.setattr(_state, "_task_join_will_block", False)
    envelope = capture(keep.signature((1,), ignore_result=ignore_result))
    backend: Any = app.backend
    subscribed = backend.result_consumer._pubsub
    app.close()
    assert envelope.headers["ignore_result"] is ignore_result
    assert subscribed is None  # no pub/sub connection was made for it


def test_deferrals_write_their_state_through_one_backend_per_process(redis_base: str) -> None:
    """Celery's app.backend is one per thread (per green thread under gevent and eventlet):
    the THROTTLED writes share one instead of building and connecting one per task."""
    import threading

    from celery_throttle.integration.visible import backend_of

    app = Celery("envelope", broker="memory://", backend=f"{redis_base}/{databases.SCRATCH}",
                 set_as_current=False)

    @app.task(name="envelope.state", shared=False)
    def state() -> None:
        return None

    seen: list[object] = []
    threads = [threading.Thread(target=lambda: seen.append(backend_of(state)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    per_thread = []
    other = threading.Thread(target=lambda: per_thread.append(app.backend))
    other.start()
    other.join(5)
    app.close()
    assert len(seen) == 3
    assert len({id(b) for b in seen}) == 1
    assert per_thread[0] is not seen[0]  # (the control: Celery's own is per thread)


def test_a_countdown_re_publish_is_the_task_s_message_and_subscribes_to_no_result(
    redis_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The countdown path re-publishes the running task's message with an ETA and this
    package's header, its ignore_result as it was, without subscribing to its result, to
    its queue's lane (ahead of the queue's backlog)."""
    from celery import _state

    from celery_throttle.integration.exits import republish as _republish
    from celery_throttle.room.header import WaitState

    broker = f"{redis_base}/{databases.SCRATCH}"
    app = Celery("envelope", broker=broker, backend=f"{redis_base}/{databases.SCRATCH}",
                 set_as_current=False)

    @app.task(name="envelope.again", shared=False, bind=True)
    def again(self: Any, a: int) -> int:
        return a

    monkeypatch.setattr(_state, "_task_join_will_block", False)
    with Connection(broker) as conn:
        queue = conn.SimpleQueue("celery.dispatched")
        queue.clear()
        again.push_request(id="t-again", args=(7,), kwargs={}, headers={}, retries=0,
                           delivery_info={"exchange": "", "routing_key": "celery"},
                           ignore_result=False)
        try:
            _republish(again, WaitState(deferrals=1), 30.0)
        finally:
            again.pop_request()
        message = queue.get(timeout=5)
        queue.close()
    backend: Any = app.backend
    subscribed = backend.result_consumer._pubsub
    app.close()
    headers: dict[str, Any] = message.headers
    assert headers["id"] == "t-again"
    assert headers["eta"] is not None
    assert headers["ignore_result"] is False
    assert headers["celery_throttle"]["deferrals"] == 1
    assert subscribed is None


@pytest.mark.parametrize(("serializer", "compression"), [("json", None), ("pickle", "zlib")])
def test_a_received_message_is_published_again_as_it_was_sent(
    redis_base: str, serializer: str, compression: str | None
) -> None:
    """A task's message as a worker receives it (kombu hands the body over decompressed)
    becomes an envelope that publishes the same task: arguments, headers, priority, queue."""
    broker = f"{redis_base}/{databases.SCRATCH}"
    app = Celery("envelope", broker=broker, set_as_current=False)
    app.conf.update(task_serializer=serializer, task_compression=compression,
                    accept_content=[serializer])

    @app.task(name="envelope.add", shared=False)
    def add(a: int, b: int = 2) -> int:
        return a + b

    with Connection(broker) as conn:
        received = conn.SimpleQueue("arrive-q", accept=[serializer])
        again = conn.SimpleQueue("again-q", accept=[serializer])
        received.clear()
        again.clear()
        add.apply_async((1,), {"b": 3}, queue="arrive-q", priority=4)
        message = received.get(timeout=5)
        envelope = Envelope.of_message(message, {"celery_throttle": {"entry": "e1"}})
        Envelope.loads(envelope.dumps()).to("again-q").publish(conn.Producer())
        copy = again.get(timeout=5)
        body = copy.decode()
        headers: dict[str, Any] = dict(copy.headers)
        properties: dict[str, Any] = dict(copy.properties)
        received.close()
        again.close()
    app.close()
    assert envelope.routing_key == "arrive-q"
    assert set(envelope.properties) <= {"correlation_id", "reply_to", "delivery_mode",
                                        "priority"}
    assert "compression" not in envelope.headers
    assert (list(body[0]), body[1]) == ([1], {"b": 3})
    assert headers["task"] == "envelope.add"
    assert headers["id"] == message.headers["id"]
    assert headers["celery_throttle"] == {"entry": "e1"}
    assert properties["priority"] == 4
    assert properties["correlation_id"] == message.headers["id"]


_PUBLISH_SETTINGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("sent events", {"task_send_sent_event": True}, {}),
    ("protocol 1", {"task_protocol": 1}, {}),
    ("protocol 1, sent events", {"task_protocol": 1, "task_send_sent_event": True}, {}),
    ("pickle, zlib, sent events", {"task_serializer": "pickle", "task_compression": "zlib",
                                   "task_send_sent_event": True}, {}),
    ("msgpack, bzip2", {"task_serializer": "msgpack", "task_compression": "bzip2"}, {}),
    ("routed queue", {"task_routes": {"envelope.routed": {"queue": "routed-q"}},
                      "task_send_sent_event": True}, {}),
    ("priority", {"task_send_sent_event": True}, {"priority": 7}),
    ("transient", {"task_default_delivery_mode": "transient",
                   "task_send_sent_event": True}, {}),
]


@pytest.mark.parametrize(("settings", "options"), [(s, o) for _, s, o in _PUBLISH_SETTINGS],
                         ids=[name for name, _, _ in _PUBLISH_SETTINGS])
def test_a_capture_keeps_the_task_s_own_message_whatever_celery_publishes_beside_it(
    redis_base: str, settings: dict[str, Any], options: dict[str, Any]
) -> None:
    """Under the publish settings an app may set (task-sent events, which Celery publishes
    through the same producer after the task; protocol 1 and 2; serializers and
    compression; a routed queue; priority; transient delivery) the capture is the task's
    message, and published it arrives as the task: its queue, id, arguments, priority and
    delivery mode."""
    broker = f"{redis_base}/{databases.SCRATCH}"
    app = Celery("envelope", broker=broker, set_as_current=False)
    serializer = str(settings.get("task_serializer", "json"))
    app.conf.update(accept_content=[serializer], **settings)

    @app.task(name="envelope.routed", shared=False)
    def routed(a: int, b: int = 2) -> int:
        return a + b

    queue_name = "routed-q" if "task_routes" in settings else "celery"
    envelope = Envelope.loads(capture(routed.signature((1,), {"b": 3}, task_id="t-own",
                                                       **options)).dumps())
    with Connection(broker) as conn:
        queue = conn.SimpleQueue(queue_name, accept=[serializer])
        queue.clear()
        envelope.publish(conn.Producer())
        message = queue.get(timeout=5)
        body = message.decode()
        headers: dict[str, Any] = dict(message.headers or {})
        properties: dict[str, Any] = dict(message.properties)
        queue.close()
    app.close()
    assert envelope.routing_key == queue_name
    if settings.get("task_protocol") == 1:
        assert (body["task"], body["id"], list(body["args"]), body["kwargs"]) == (
            "envelope.routed", "t-own", [1], {"b": 3})
    else:
        assert (headers["task"], headers["id"]) == ("envelope.routed", "t-own")
        assert (list(body[0]), body[1]) == ([1], {"b": 3})
    assert properties.get("priority", 0) == options.get("priority", 0)
    transient = settings.get("task_default_delivery_mode") == "transient"
    assert properties["delivery_mode"] == (1 if transient else 2)


def test_a_capture_that_cannot_tell_the_task_s_message_is_refused_by_name() -> None:
    """When Celery publishes more than one message that looks like a task's (an AMQP class
    of the app's that sends each task twice), the capture refuses, naming the task and the
    settings that shape what Celery publishes, instead of keeping a guess."""
    from celery.app.amqp import AMQP

    class Twice(AMQP):
        def send_task_message(self, producer: Any, name: str, message: Any,
                              **kwargs: Any) -> Any:
            sender = self._create_task_sender()  # type: ignore[attr-defined]
            headers, properties, body, _sent_event = message
            sender(producer, name, (dict(headers), dict(properties), body, None), **kwargs)
            return sender(producer, name, message, **kwargs)

    app = Celery("envelope", broker="memory://", set_as_current=False, amqp=Twice)

    @app.task(name="envelope.twice", shared=False)
    def twice() -> None:
        return None

    with pytest.raises(RuntimeError, match=r"'envelope\.twice'.*task_send_sent_event"):
        capture(twice.signature(()))
    app.close()


def test_a_copy_routed_by_an_exchange_reaches_its_queue_from_a_connection_that_never_saw_it(
    redis_base: str
) -> None:
    """A task routed through a topic exchange (its queue bound by a pattern, declared by a
    worker's connection): its copy, published from another connection (a dispatcher's, a
    pool process's), reaches the queue.  The Redis transport knows an exchange's type only
    from a declaration on its own connection, and routes an exchange it has not seen as a
    direct one: the pattern matched nothing, and the copy was dropped."""
    import redis as redis_py
    from kombu import Exchange, Queue

    broker = f"{redis_base}/{databases.SCRATCH}"
    tasks = Exchange("tasks", type="topic")
    imports = Queue("imports", tasks, routing_key="tasks.#")
    app = Celery("envelope", broker=broker, set_as_current=False)
    app.conf.update(task_queues=[imports, Queue("celery")],
                    task_routes={"envelope.imported": {"queue": "imports",
                                                       "routing_key": "tasks.import"}})

    @app.task(name="envelope.imported", shared=False)
    def imported(a: int) -> int:
        return a

    store = redis_py.Redis.from_url(broker)
    store.delete("imports")
    envelope = Envelope.loads(capture(imported.signature((1,))).dumps())
    assert (envelope.exchange, envelope.routing_key) == ("tasks", "tasks.import")
    with Connection(broker) as worker:  # (what a worker's consumer declares)
        imports(worker.default_channel).declare()
    with Connection(broker) as conn:
        envelope.publish(conn.Producer(), queues=app.amqp.queues)
    queued = store.llen("imports")
    store.delete("imports")
    store.close()
    app.close()
    assert queued == 1


def test_only_a_queue_reached_by_name_gets_a_lane_and_it_keeps_its_priorities() -> None:
    """A worker consumes the lane of each queue Celery sends tasks to by name (a direct
    exchange), with the queue's ``max_priority`` and arguments; none for a queue of a
    topic, fanout (``Broadcast``) or headers exchange, where a lane bound to the exchange
    would take a second copy of what it routes there (each broadcast task run twice)."""
    from celery.app.amqp import Queues
    from kombu import Exchange, Queue
    from kombu.common import Broadcast

    from celery_throttle.room.dispatcher import add_lanes

    queues = Queues([
        Queue("celery"),
        Queue("urgent", Exchange("urgent"), routing_key="urgent", max_priority=9,
              queue_arguments={"x-queue-type": "classic"}),
        Queue("imports", Exchange("tasks", type="topic"), routing_key="tasks.#"),
        Broadcast("everyone"),
        Queue("matched", Exchange("by-header", type="headers"), binding_arguments={"a": 1}),
    ])
    queues.select(["celery", "urgent", "imports", "everyone", "matched"])
    assert sorted(add_lanes(queues)) == ["celery.dispatched", "urgent.dispatched"]
    lane = queues["urgent.dispatched"]
    assert (getattr(lane, "max_priority", None), lane.queue_arguments) == (
        9, {"x-queue-type": "classic"})
    assert lane.exchange.name == "urgent"


@pytest.mark.parametrize(("retries", "expected"), [(None, None), (3, 20), (50, 50), (0, 20)])
def test_a_re_publish_outlasts_a_broker_restart_and_keeps_a_policy_of_for_ever(
    retries: int | None, expected: int | None
) -> None:
    """A task re-published to wait tries the broker at least as long as a restart takes,
    longer if the app's ``task_publish_retry_policy`` says so, and for ever where it says
    ``max_retries=None`` (kombu's reading of it), never fewer times."""
    from celery_throttle.integration.exits import _outlasting

    policy = _outlasting({"max_retries": retries, "interval_max": 0.2})
    assert policy["max_retries"] == expected
    assert policy["interval_max"] >= 1.0
