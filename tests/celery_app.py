"""The Celery app that integration tests run in real worker processes.

Every task records its start (time, id, retries, deferrals, pid) in a Redis
list; tests judge only from those records and from the result backend.
Configured from the environment: CT_REDIS (server URL; the broker, store,
results and records on databases of the test process's own, tests/databases.py;
CT_BROKER names another broker), CT_PREFIX (the bucket prefix) and
CT_CONF (settings, as JSON); a fault is injected at one of
celery_throttle.faults' points (CT_FAULT: the node dies; CT_STALL: the
process stalls; CT_RAISE: the connection is lost there, once) or as a
skewed clock (CT_CLOCK_OFFSET).  CT_PROVIDER, CT_LEASE and CT_NO_SETTLE
shape the provider tasks, CT_NO_INSTALL leaves install() out.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, Task, current_task, shared_task

import celery_throttle
from celery_throttle import HEADER, throttled

from . import databases

REDIS = os.environ.get("CT_REDIS", "redis://127.0.0.1:6379")
RECORDS_KEY = "records"
STORE = f"{REDIS}/{databases.STORE}"
# CT_BROKER: another broker (the RabbitMQ tests' amqp:// URL); the Redis test server's by default.
BROKER = os.environ.get("CT_BROKER") or f"{REDIS}/{databases.BROKER}"

app = Celery("ct_tests", broker=BROKER, backend=f"{REDIS}/{databases.RESULTS}")
app.conf.update(
    throttle_redis_url=STORE,
    throttle_prefix=os.environ.get("CT_PREFIX", "throttle"),
    throttle_queues={"ext": "10/s", "bursty": {"rate": "10/s", "burst": 3}},
    broker_connection_retry_on_startup=True,
    task_default_queue="celery",
    result_expires=600,
)
# CT_CONF: the settings a test changes, as one JSON object (tests/workers.py
# writes it from cluster(conf=...)); applied before install() validates them.
app.conf.update(json.loads(os.environ.get("CT_CONF") or "{}"))
if not os.environ.get("CT_NO_INSTALL"):  # the forgotten-install warning's test
    celery_throttle.install(app)

_records = redis.Redis.from_url(f"{REDIS}/{databases.RECORDS}")


def record(task: Task[Any, Any], **extra: Any) -> None:
    """Append this start to the records list (time first: that is what is judged)."""
    now = time.time()
    header = (task.request.headers or {}).get(HEADER) or {}
    queue = (task.request.delivery_info or {}).get("routing_key")
    _records.rpush(RECORDS_KEY, json.dumps({
        "t": now, "task": task.name, "id": task.request.id, "retries": task.request.retries,
        "deferrals": header.get("deferrals", 0), "slot": header.get("started_slot"),
        "pid": os.getpid(), "eta": task.request.eta,
        "host": task.request.hostname, "queue": queue, **extra,
    }))


@throttled("20/s")
@app.task(bind=True)
def steady(self: Task[Any, Any], i: int) -> int:
    """One bucket shared by every worker at 20/s."""
    record(self, i=i)
    return i


@throttled("20/s", name="green")
@app.task(bind=True)
def io_call(self: Task[Any, Any], i: int) -> int:
    """A start at 20/s, then 0.2 s of I/O (a provider call), for the green-thread pools."""
    record(self, i=i)
    time.sleep(0.2)
    return i


@throttled("5/s", key="tenant")
@app.task(bind=True)
def per_tenant(self: Task[Any, Any], tenant: str, i: int) -> str:
    """One bucket per tenant at 5/s."""
    record(self, tenant=tenant, i=i)
    return tenant


@throttled("2/s", name="own-slow")
@throttled("10/s", name="shared")
@app.task(bind=True)
def held_by_own(self: Task[Any, Any], i: int) -> int:
    """Held by its own slow limit; must not eat the shared limit while it waits."""
    record(self, i=i)
    return i


@throttled("10/s", name="shared")
@app.task(bind=True)
def sibling(self: Task[Any, Any], i: int) -> int:
    """Uses only the shared limit."""
    record(self, i=i)
    return i


@throttled("10/s", name="openai")
@throttled("200/s", name="openai-tokens", burst=40,
           cost=lambda prompt, **kw: max(1, len(prompt) // 4))
@app.task(bind=True)
def summarize(self: Task[Any, Any], prompt: str) -> int:
    """Stacked request and token limits, passed together."""
    record(self, tokens=max(1, len(prompt) // 4))
    return len(prompt)


@app.task(bind=True)
def total(self: Task[Any, Any], values: list[int]) -> int:
    """A chord's callback (no limit of its own): records its run, sums the header's results."""
    record(self, n=len(values))
    return sum(values)


@throttled("5/s")
@app.task(bind=True, max_retries=0)
def no_retries(self: Task[Any, Any], i: int) -> int:
    """max_retries=0: waiting for the throttle must not spend retries."""
    record(self, i=i)
    return i


@throttled("2/s")
@app.task(bind=True)
def expiring(self: Task[Any, Any], i: int) -> int:
    """Sent with expires=: must never run after its expiry."""
    record(self, i=i)
    return i


@app.task(bind=True)
def undecorated(self: Task[Any, Any], i: int) -> int:
    """No decorator: limited only by its queue's throttle_queues entry."""
    record(self, i=i)
    return i


@app.task
def garbage_report() -> dict[str, int]:
    """How many of Celery's ``ExceptionInfo`` objects this pool process holds (memory test)."""
    import gc

    held = sum(type(o).__name__ == "ExceptionInfo" for o in gc.get_objects())
    return {"pid": os.getpid(), "held": held, "frozen": gc.get_freeze_count()}


@throttled("10/s")
@shared_task
def shared_one(i: int) -> int:
    """A shared_task (not bound) under @throttled."""
    record(current_task, i=i)
    return i


@throttled("1/s", max_wait=1.5)
@app.task(bind=True)
def impatient(self: Task[Any, Any], i: int) -> int:
    """Fails with ThrottleTimeout rather than wait more than 1.5 s."""
    record(self, i=i)
    return i


@throttled("1/2s", name="hops")
@app.task(bind=True)
def long_wait(self: Task[Any, Any], i: int) -> int:
    """Waits several seconds; with a 1 s max countdown that takes several hops."""
    record(self, i=i)
    return i


@throttled("5/s")
@app.task(bind=True, max_retries=3)
def retry_once(self: Task[Any, Any], i: int) -> int:
    """Retries itself at once after its first start: each start must pass the gate anew."""
    record(self, i=i)
    if self.request.retries == 0:
        raise self.retry(countdown=0.01)
    return i


@throttled("5/s", burst=5, name="trial", enforce=False)
@app.task(bind=True)
def trial(self: Task[Any, Any], i: int) -> int:
    """A limit tried in shadow mode: decided and counted, never waited for."""
    record(self, i=i)
    return i


@throttled("1/s", name="patient")
@app.task(bind=True)
def patient(self: Task[Any, Any], i: int) -> int:
    """Waits up to tens of seconds: longer than a short broker visibility timeout."""
    record(self, i=i)
    return i


# --- Concurrency leases, provider feedback, settled token costs ---
# CT_PROVIDER: the mock provider's URL (a real HTTP server in the test process).
# CT_LEASE: the concurrency leases' length in seconds.

PROVIDER = os.environ.get("CT_PROVIDER", "http://127.0.0.1:9")
LEASE = float(os.environ.get("CT_LEASE", "30"))


def estimate_tokens(prompt: str, factor: float) -> int:
    """The token estimate charged up front: the true count times ``factor`` (0.5-2)."""
    return max(1, round(len(prompt) // 4 * factor))


@throttled("8/s", name="p-requests")
@throttled(concurrency=3, name="p-inflight", lease=LEASE)
@throttled("90/s", name="p-tokens", burst=80,
           cost=lambda prompt, factor, work: estimate_tokens(prompt, factor))
@app.task(bind=True)
def llm_call(self: Task[Any, Any], prompt: str, factor: float, work: float) -> int:
    """A provider call under requests/s, calls in flight and tokens/s, tokens settled after."""
    from examples import provider

    record(self, factor=factor)
    try:
        body = provider.summarize(PROVIDER, prompt, work=work)
    except provider.RateLimited as exc:
        raise celery_throttle.RateLimited(exc.retry_after) from None
    used = int(body["usage"]["total_tokens"])
    if not os.environ.get("CT_NO_SETTLE"):  # the negative control of the settlement test
        assert celery_throttle.settle(used)
    _records.rpush("calls", json.dumps({"id": self.request.id, "t": time.time(),
                                        "tokens": used, "retries": self.request.retries}))
    return used


_sdk_clients: dict[str, Any] = {}


def _sdk_client() -> Any:
    """This process's OpenAI client, every request gated on the task's own limit."""
    if "openai" not in _sdk_clients:
        import openai

        from celery_throttle.transport import gated_client

        _sdk_clients["openai"] = openai.OpenAI(
            base_url=f"{PROVIDER}/v1", api_key="sk-test", http_client=gated_client(
                "9/s", name="sdk-requests", url=STORE, prefix=app.conf.throttle_prefix))
    return _sdk_clients["openai"]


@throttled("9/s", name="sdk-requests")
@app.task(bind=True)
def sdk_chat(self: Task[Any, Any], i: int) -> str:
    """A chat completion through the OpenAI SDK (its default retries on), gated twice over:
    the task's admission, spent by its first request, and every retry by the transport."""
    record(self)
    reply = _sdk_client().chat.completions.create(
        model="mock", messages=[{"role": "user", "content": f"document {i}"}])
    return str(reply.choices[0].message.content)


@throttled("9/s", name="sdk-money")
@app.task(bind=True)
def sdk_chat_checked(self: Task[Any, Any], i: int) -> str:
    """:func:`sdk_chat` on its own limit, the SDK's errors read by ``check_response``: an
    answer that says the money is spent stops the limit (the gated client raises
    LimitStopped, past the SDK), and the task waits for the resume."""
    import openai

    from celery_throttle.transport import gated_client

    if "money" not in _sdk_clients:
        _sdk_clients["money"] = openai.OpenAI(
            base_url=f"{PROVIDER}/v1", api_key="sk-test", http_client=gated_client(
                "9/s", name="sdk-money", url=STORE, prefix=app.conf.throttle_prefix))
    try:
        reply = _sdk_clients["money"].chat.completions.create(
            model="mock", messages=[{"role": "user", "content": f"document {i}"}])
    except openai.APIError as exc:
        celery_throttle.check_response(exc)
        raise
    record(self)
    return str(reply.choices[0].message.content)


@throttled("30/s", name="learning-api", adaptive=True)
@app.task(bind=True)
def learning_call(self: Task[Any, Any], i: int) -> int:
    """A call of a provider with no rate-limit headers and a quota under the declared 30/s:
    its bare 429s, read by ``check_response``, teach the limit the quota."""
    import httpx

    response = httpx.post(f"{PROVIDER}/v1/chat/completions", timeout=10,
                          json={"model": "mock", "messages": [{"role": "user", "content": "x"}]})
    celery_throttle.check_response(response)
    record(self, i=i)
    return i


@throttled(concurrency=1, name="one-seat", lease=LEASE)
@app.task(bind=True)
def one_seat(self: Task[Any, Any], seconds: float) -> float:
    """Holds the only seat of its limit for ``seconds`` (bounded by the test)."""
    record(self, seconds=seconds)
    time.sleep(seconds)
    return seconds


@throttled("1/s", name="cut-off")
@app.task(bind=True)
def cut_off(self: Task[Any, Any], i: int, seconds: float) -> int:
    """Works ``seconds`` after its start: a call a node's crash may cut off (bounded by the
    test)."""
    record(self, i=i)
    time.sleep(seconds)
    return i


@throttled("5/s", name="room")
@app.task(bind=True, serializer="pickle")
def parked_pickle(self: Task[Any, Any], i: int, payload: Any = None) -> int:
    """Pickle-serialized, waits seconds at 5/s: parked and dispatched with its own serializer."""
    record(self, i=i, kind=type(payload).__name__)
    return i


@throttled("5/s", name="room")
@app.task(bind=True, serializer="msgpack")
def parked_msgpack(self: Task[Any, Any], i: int) -> int:
    """The same limit, msgpack-serialized."""
    record(self, i=i)
    return i


# --- The scheduler: tasks waiting in line ---
# CT_LINE_RATE: the rate of the "line" limit, as a new release of the code
# would change it (the tests restart the workers with another one).

LINE_RATE = os.environ.get("CT_LINE_RATE", "5/s")


@throttled(LINE_RATE, name="line")
@app.task(bind=True)
def in_line(self: Task[Any, Any], i: int) -> int:
    """One limit shared by a batch and urgent work, sent with Celery's own priorities."""
    record(self, i=i, priority=(self.request.delivery_info or {}).get("priority"))
    return i


@throttled("10/s", name="fair", fair="tenant")
@app.task(bind=True)
def fair_line(self: Task[Any, Any], tenant: str, i: int) -> int:
    """One limit shared by tenants, served by tenant in turn."""
    record(self, i=i, tenant=tenant)
    return i


@throttled("20/s", name="fast_fair", fair="tenant")
@app.task(bind=True)
def fast_fair(self: Task[Any, Any], tenant: str, i: int) -> int:
    """A limit faster than the processes need to sleep, shared by tenants in turn."""
    record(self, i=i, tenant=tenant)
    return i


# --- Fault injection, per worker node (set only in that node's environment) ---

if os.environ.get("CT_FAULT"):
    # CT_FAULT names a point of celery_throttle.faults: the node dies there
    # (SIGKILL, whole process group) the first time any node reaches it,
    # after recording when ("crashed" in the records database).  With
    # CT_FAULT_KILLS (a process group id: a broker the test started), that
    # group is killed instead, and the node goes on.
    from celery_throttle import faults

    _victim = int(os.environ.get("CT_FAULT_KILLS") or 0)

    def _die_once(*args: object) -> None:
        # (The task's id, where the point's argument is a task.)
        task_id = getattr(getattr(args[0] if args else None, "request", None), "id", None)
        if _records.set("crashed", json.dumps({"t": time.time(), "id": task_id}), nx=True):
            os.killpg(_victim or os.getpgid(0), signal.SIGKILL)

    faults.inject(os.environ["CT_FAULT"], _die_once)

if os.environ.get("CT_STALL"):
    # CT_STALL="point:seconds:every": each process stalls ``seconds`` at that
    # point of celery_throttle.faults every ``every``-th time it reaches it
    # (a process woken late: a loaded machine, a container out of CPU quota).
    from celery_throttle import faults

    _point, _seconds, _every = os.environ["CT_STALL"].split(":")
    _reached = [0]

    def _stall(*_: object) -> None:
        _reached[0] += 1
        if _reached[0] % int(_every) == 0:
            time.sleep(float(_seconds))

    faults.inject(_point, _stall)

if os.environ.get("CT_RAISE"):
    # CT_RAISE names a point of celery_throttle.faults: the first time any node
    # reaches it, a connection error is raised there (the connection lost at
    # that moment), after recording the task's id ("raised" in the records).
    from celery_throttle import faults

    def _raise_once(*args: object) -> None:
        task_id = getattr(getattr(args[0] if args else None, "request", None), "id", None)
        if _records.set("raised", json.dumps({"t": time.time(), "id": task_id}), nx=True):
            raise ConnectionResetError(f"connection lost at {os.environ['CT_RAISE']}")

    faults.inject(os.environ["CT_RAISE"], _raise_once)

if os.environ.get("CT_CLOCK_OFFSET"):
    # A node whose wall clock is off by CT_CLOCK_OFFSET seconds, where Celery
    # reads it: the ETA computed from a countdown when publishing (app.now)
    # and the ETA timer when receiving (kombu converts ETAs with time.time).
    # Records keep the true time: they are what the test judges.
    import kombu.asynchronous.timer as _timer

    _offset = float(os.environ["CT_CLOCK_OFFSET"])
    _true_now = app.now
    app.now = lambda: _true_now() + dt.timedelta(seconds=_offset)  # type: ignore[method-assign]
    _timer._time = lambda: time.time() + _offset  # type: ignore[attr-defined]
