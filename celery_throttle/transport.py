"""Gate every HTTP request a client sends, its SDK's retries included.

The official ``openai`` and ``anthropic`` SDKs retry a refused or failed
request themselves (twice by default), sleeping what the provider's
``retry-after-ms`` says.  A limit applied around the call (``@throttled``,
``Gate.wait``, LangChain's ``rate_limiter=``) sees the first attempt only:
the retries of every process that was refused in the same instant reach
the provider together, and its 429s never reach the limit.  A transport
sees every attempt, just before it is sent::

    from openai import OpenAI
    from celery_throttle.transport import gated_client

    client = OpenAI(http_client=gated_client("500/m", name="openai", url=REDIS_URL))

Before each attempt the transport waits for a start of its limits
(:meth:`Gate.wait`: the start is booked, so waiters never herd).  An answer
that says the quota is spent (a 429; read by ``answers.classify``, with the
body of an error answer, so an answer that says the money is spent counts
too) pauses those limits on every worker and web process for the
provider's ``retry-after-ms`` / ``retry-after`` (as :class:`RateLimited`
does) and is handed back to the client unchanged: the SDK's retry then
waits in the transport until the pause ends and its own booked start comes.
An overloaded provider's answer (529, 503) holds those limits off on every
worker and web process (``answers.Backoff``: from 1 s, doubled per overload
in a row, reset by a success) without pausing them (``Gate.follow`` with
nothing left until then: their quota untouched), and is handed back as it
is: the SDK's retry waits in the transport until the hold-off ends.  An
answer that says the account's money is spent stops those limits until
resumed (``Gate.stop``: every worker and web process, said once as an
ERROR) and raises :class:`~celery_throttle.LimitStopped`; so does every
later request of a stopped limit, at once and without being sent (the SDK
wraps it in its connection error, whose retries then fail here too).

Every other answer's rate-limit headers (OpenAI's ``x-ratelimit-remaining-
requests``/``-reset-requests``, Anthropic's ``anthropic-ratelimit-requests-
remaining``/``-reset``) say how much of the provider's quota is left, which
callers the gate cannot see (another service on the same API key) spend
too: when that is less than the limit would spend before the provider's
reset, the limit spends no more (:meth:`Gate.follow`, on every worker at
once).  A report that cannot bind costs no round trip.

Token quotas (``tokens=``; Anthropic's ``input_tokens=`` and
``output_tokens=``) charge each request what it may cost at most, read from
its JSON body, and settle it from the answer's ``usage`` (``usage.py``).

Inside a Celery task admitted under the same limit (``@throttled`` with the
same name and key), the task's admission is its first request's start: the
transport spends it instead of charging the limit again
(``core/credit.py``), if the request goes out within half an interval of
the admission (:data:`DEFAULT_GRACE` at most); a later one gives that
start back and waits for a fresh start, so a start never comes late.

Works with ``httpx`` and ``httpx2`` (the SDKs' own) clients, sync and async:
the transport wraps the client's usual one.  Rate limits only: a request's
end is not its response's, which a client may stream long after.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import metrics, usage
from .answers import MAX_BODY, Backoff, Hook, classify
from .client_limits import TokenQuota, limits_of, meters, token_limits
from .core import credit, learners
from .core.async_gate import AsyncGate, LoopGates
from .core.gate import Gate
from .core.keys import learners_key
from .core.limits import ADMITTED, Decision, Limit, pauses_for_refusal
from .core.live import LiveLimits
from .core.logs import logger
from .core.rates import Rate
from .core.stops import Stop
from .core.waiting import DEFAULT_GRACE
from .errors import MAX_RETRY_AFTER, LimitStopped, ThrottleTimeout
from .provider_headers import reports_of

__all__ = ["AsyncGatedTransport", "GatedTransport", "async_gated_client", "gated_client"]

#: The HTTP packages a transport is made for, in order of preference (the
#: SDKs send through httpx2).
HTTP_PACKAGES = ("httpx2", "httpx")


def _base(package: str, name: str) -> type:
    """``package``'s transport base class ``name``, or an empty stand-in if it is absent."""
    try:
        found: type = getattr(importlib.import_module(package), name)
    except ImportError:
        found = type(f"_No{package.capitalize()}{name}", (), {})
    return found


# A transport is an instance of both packages' base classes, so either
# package's client takes it (and type-checks it).
if TYPE_CHECKING:
    from httpx import AsyncBaseTransport as _HttpxAsyncBase
    from httpx import BaseTransport as _HttpxBase
    from httpx2 import AsyncBaseTransport as _Httpx2AsyncBase
    from httpx2 import BaseTransport as _Httpx2Base
else:
    _Httpx2Base, _HttpxBase = _base("httpx2", "BaseTransport"), _base("httpx", "BaseTransport")
    _Httpx2AsyncBase = _base("httpx2", "AsyncBaseTransport")
    _HttpxAsyncBase = _base("httpx", "AsyncBaseTransport")


def _http_package(module: str | None) -> Any:
    """The ``httpx2`` or ``httpx`` module (``module`` names it; default: the first installed)."""
    names = HTTP_PACKAGES if module is None else (module,)
    if module is not None and module not in HTTP_PACKAGES:
        raise ValueError(f"module {module!r}: expected one of {list(HTTP_PACKAGES)}")
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"{' or '.join(names)} is not installed: pip install "
                      f"'celery-gcra-throttle[http]' (the openai and anthropic SDKs bring httpx2)")


@dataclass(frozen=True, slots=True)
class _Attempt:
    """What one attempt waits for, and what it charged each token limit (to settle)."""

    wait: list[Limit]
    stale: list[credit.Admission]  # the task's admissions too old to spend: give back
    charged: list[tuple[str, Limit]]  # (part, the token limit as charged)


@dataclass(frozen=True, slots=True)
class _Step:
    """A call on the gate after the answer: ``op`` is the gate's method's name."""

    op: str  # "pause" | "stop" | "follow" | "settle"
    args: tuple[Any, ...]
    options: dict[str, Any] = field(default_factory=dict)


class _Gated:
    """What both transports share: before an attempt, and after its answer (no I/O here).

    ``meters``: the token limits by what they count (``usage.PARTS``).
    """

    def __init__(self, limits: list[Limit], meters: dict[str, Limit], inner: Any,
                 timeout: float | None, grace: float, follow: bool,
                 answers: Hook | None) -> None:
        self.answers = answers
        self.backoff = Backoff()
        self.limits = limits
        self.meters = meters
        self.inner = inner
        self.timeout = timeout
        self.grace = grace
        self.follow = follow
        self.every = [*limits, *meters.values()]
        self.names = sorted({lim.name for lim in self.every})
        # Its limits that learn, written once where `status` finds them (core/learners.py).
        self.unwritten = learners.fields(self.every)

    def _before(self, request: Any, key_of: Any) -> _Attempt:
        """The limits to wait for (each token limit charged the request's estimate), the
        stale admissions to give back, and the token charges.

        A limit whose start the running task was admitted for is spent from
        that admission when it is fresh (half an interval, at most the grace):
        a token limit's then stands for the request's estimate, and is settled.
        """
        keys = {key_of(lim): lim for lim in self.every}
        taken = credit.take(keys)
        now = time.monotonic()
        fresh = {key: adm for key, adm in taken.items()
                 if adm.fresh(min(self.grace, adm.limit.rate.interval_us / 2e6), now)}
        stale = [adm for key, adm in taken.items() if key not in fresh]
        wait = [lim for key, lim in keys.items() if key not in fresh]
        charged: list[tuple[str, Limit]] = []
        body = _body(request) if self.meters else b""
        for part, meter in self.meters.items():
            spent = fresh.get(key_of(meter))
            if spent is not None:  # the task was charged its own estimate: settle that
                charged.append((part, spent.limit))
            else:
                cost = min(meter.burst, usage.estimate(body, part))
                charged.append((part, replace(meter, cost=cost)))
                wait[wait.index(meter)] = charged[-1][1]
        return _Attempt(wait, stale, charged)

    def _needs_body(self, response: Any, attempt: _Attempt) -> bool:
        """Whether the answer must be read here: an error's, to read what it means; JSON, to
        settle its tokens, or for the ``answers`` hook.  Never a stream, nor a body
        longer than an error's (``answers.MAX_BODY``)."""
        headers = response.headers
        kind = str(headers.get("content-type", ""))
        if kind.startswith("text/event-stream"):
            return False
        length = headers.get("content-length")
        if length is not None and (not str(length).isdigit() or int(length) > MAX_BODY) \
                and response.status_code >= 300:
            return False
        if response.status_code >= 400:
            return True
        return kind.startswith("application/json") and (
            self.answers is not None or (bool(attempt.charged) and response.status_code < 300))

    def _after(self, response: Any, attempt: _Attempt, body: bytes | None,
               admitted: float) -> list[_Step]:
        """The gate calls an answer asks for: a 429 pauses the limits (and its tokens were not
        spent; a limit that learns is cut); the headers' reports are followed; the tokens
        used are settled.  ``admitted``: when the request's start was decided
        (``time.monotonic``, :func:`_admitted`)."""
        steps: list[_Step] = []
        answer = classify(response.status_code, response.headers, body, self.answers) \
            if body is not None or response.status_code >= 400 else None
        if answer is not None and answer.kind == "overloaded":
            # Busy for everyone: every caller holds off, the quota untouched (no pause).
            return [_Step("follow", (self.limits, 0, self.backoff.next(answer.retry_after))),
                    *(_Step("settle", (limit, 0)) for _, limit in attempt.charged)]
        if 200 <= response.status_code < 300:
            self.backoff.reset()
        if answer is not None:
            metrics.provider_paused(self.names)
            steps += [_Step("settle", (limit, 0)) for _, limit in attempt.charged]
            if answer.kind == "money":
                return [*steps, _Step("stop", (self.every, "money", answer.message or "money"))]
            refused = {"refused_after": max(0.0, time.monotonic() - admitted)}
            return [*steps, *(_Step("pause", (limits, seconds), refused) for limits, seconds
                              in pauses_for_refusal(self.every, answer.retry_after or 0.0,
                                                    answer.named))]
        if self.follow:
            for report in reports_of(response.headers):
                which = self.limits if report.kind == "requests" else (
                    [self.meters[report.kind]] if report.kind in self.meters else [])
                if which:
                    steps.append(_Step("follow", (which, report.remaining, report.reset)))
        if body is not None:
            for part, limit in attempt.charged if response.status_code < 300 else ():
                actual = usage.used(body, part)
                if actual is not None:
                    steps.append(_Step("settle", (limit, actual)))
        return steps

    def _probe(self) -> float:
        """The wait asked for first: the caller's ``timeout``, at most the longest pause a
        provider's answer writes (``MAX_RETRY_AFTER``); a longer wait is a stop, or an
        operator's pause, which :meth:`_past_probe` tells apart."""
        return MAX_RETRY_AFTER if self.timeout is None else min(self.timeout, MAX_RETRY_AFTER)

    def _past_probe(self, stop: Stop | None, exc: ThrottleTimeout) -> None:
        """The probe's wait timed out: raise :class:`LimitStopped` for a stop, ``exc`` past
        the caller's own timeout; return to wait the rest (no timeout, or a longer one)."""
        if stop is not None:
            raise self._stopped(stop) from None
        if self.timeout is not None and self.timeout <= MAX_RETRY_AFTER:
            raise exc

    def _stopped(self, stop: Stop) -> LimitStopped:
        return LimitStopped.of(stop.limit, stop.reason, stop.message)

    def _said(self, step: _Step, result: Any) -> None:
        """After a step ran: a stop this call made is said once, as an ERROR, and raised."""
        if step.op != "stop":
            return
        names = ", ".join(self.names)
        if result:
            logger.error("throttle: %s stopped on every worker and web process until "
                         "resumed: the provider says the account's money is spent (%r); "
                         "`celery throttle resume NAME` once it is not", names, step.args[2])
        raise LimitStopped.of(self.names[0], step.args[1], step.args[2])

    def __repr__(self) -> str:
        shown = ", ".join(f"{lim.name}={lim.rate.text}" for lim in self.every)
        return f"{type(self).__name__}({shown})"


def _admitted(decision: Decision) -> float:
    """When (``time.monotonic``) the start a request leaves in was decided: a start booked
    just ahead is admitted as it is booked, and the caller slept until it.  A refusal
    of a request admitted before a learned rate's last cut does not cut it again."""
    return time.monotonic() - decision.retry_after


def _body(request: Any) -> bytes:
    """The request's body, if it is in memory (the SDKs' JSON is); else nothing."""
    try:
        return bytes(request.content)
    except Exception:  # a streamed upload: not read here (httpx's RequestNotRead)
        return b""


class GatedTransport(_Gated, _Httpx2Base, _HttpxBase):
    """A sync ``httpx``/``httpx2`` transport: every request waits for a start of ``limits``.

    ``gate``: the :class:`Gate` on the throttle's Redis (the workers'
    ``throttle_redis_url`` and ``throttle_prefix``).  ``tokens``: a token
    limit (its cost is ignored): each request is charged its estimate
    (``usage.estimate``: prompt characters / 4 + ``max_tokens``) and
    settled from the answer's ``usage`` (JSON answers; a stream keeps the
    estimate); ``input_tokens`` and ``output_tokens``: the same for a
    provider's separate quotas (prompt characters / 4; ``max_tokens``).
    ``transport``: the one that sends (default: the package's
    ``HTTPTransport()``).  ``timeout``: a wait longer than this raises
    :class:`~celery_throttle.ThrottleTimeout` (booking nothing; an SDK may
    wrap it in its connection error).  ``live``: apply the rates set with
    ``celery throttle set`` (default).  ``follow``: follow the provider's
    remaining-requests (and -tokens) headers (default).  ``own_gate``:
    :meth:`close` closes ``gate`` too.  ``answers``: a provider's own signals
    (``answers.classify``'s hook).
    """

    def __init__(self, limits: Sequence[Limit], *, gate: Gate, tokens: Limit | None = None,
                 input_tokens: Limit | None = None, output_tokens: Limit | None = None,
                 transport: Any = None, module: str | None = None,
                 timeout: float | None = None, grace: float = DEFAULT_GRACE, live: bool = True,
                 follow: bool = True, own_gate: bool = False,
                 answers: Hook | None = None) -> None:
        chosen = limits_of(None, None, 1, None, limits)
        inner = transport if transport is not None else _http_package(module).HTTPTransport()
        super().__init__(chosen, meters(tokens, input_tokens, output_tokens), inner, timeout,
                         grace, follow, answers)
        self.gate = gate
        self.own_gate = own_gate
        self._live = LiveLimits(gate.client, gate.prefix) if live else None

    def handle_request(self, request: Any) -> Any:
        """Wait for the booked start (or spend the task's admission), send, and tell the gate
        what the answer says (a 429's pause, the quota left, the tokens used)."""
        attempt = self._before(request, self.gate.key_of)
        decision = ADMITTED
        if self.unwritten:
            self.gate.client.hset(learners_key(self.gate.prefix),
                                  mapping=self.unwritten)  # type: ignore[arg-type]
            self.unwritten = {}
        for adm in attempt.stale:
            self.gate.settle(adm.limit, 0)
        if attempt.wait:
            limits = self._live.apply(attempt.wait) if self._live else attempt.wait
            try:
                decision = self.gate.wait(limits, timeout=self._probe(), grace=self.grace)
            except ThrottleTimeout as exc:
                self._past_probe(self.gate.stopped(limits), exc)
                decision = self.gate.wait(limits, timeout=self.timeout, grace=self.grace)
        admitted = _admitted(decision)
        response = self.inner.handle_request(request)
        body = response.read() if self._needs_body(response, attempt) else None
        for step in self._after(response, attempt, body, admitted):
            if step.op == "stop":
                response.close()
            self._said(step, getattr(self.gate, step.op)(*step.args, **step.options))
        return response

    def close(self) -> None:
        """Close the transport that sends, and the gate if it is this transport's own
        (``own_gate``: made for it, as ``gated_client(url=...)`` does)."""
        self.inner.close()
        if self.own_gate:
            self.gate.close()


class AsyncGatedTransport(_Gated, _Httpx2AsyncBase, _HttpxAsyncBase):
    """:class:`GatedTransport` for async clients (``AsyncOpenAI``, ``AsyncAnthropic``).

    ``gate``: an :class:`AsyncGate`; or ``url`` (and ``prefix``), and one is
    made for each event loop the client runs on (a ``redis.asyncio`` client
    belongs to the loop that first used it).  The rates set with ``celery
    throttle set`` apply, as in the sync transport.
    """

    def __init__(self, limits: Sequence[Limit], *, gate: AsyncGate | None = None,
                 url: str | None = None, prefix: str = "throttle", tokens: Limit | None = None,
                 input_tokens: Limit | None = None, output_tokens: Limit | None = None,
                 transport: Any = None, module: str | None = None,
                 timeout: float | None = None, grace: float = DEFAULT_GRACE,
                 follow: bool = True, answers: Hook | None = None) -> None:
        if gate is None and url is None:
            raise ValueError("give gate (an AsyncGate) or url (the throttle's Redis)")
        chosen = limits_of(None, None, 1, None, limits)
        inner = (transport if transport is not None
                 else _http_package(module).AsyncHTTPTransport())
        super().__init__(chosen, meters(tokens, input_tokens, output_tokens), inner, timeout,
                         grace, follow, answers)
        self.gate = gate
        self._loop_gates = LoopGates(url, prefix) if url is not None else None
        self._live = LiveLimits(None, gate.prefix if gate is not None else prefix)

    async def handle_async_request(self, request: Any) -> Any:
        """:meth:`GatedTransport.handle_request`, awaiting the gate."""
        gate = self._gate()
        attempt = self._before(request, gate.key_of)
        decision = ADMITTED
        if self.unwritten:
            await gate.client.hset(learners_key(gate.prefix),
                                   mapping=self.unwritten)  # type: ignore[arg-type]
            self.unwritten = {}
        for adm in attempt.stale:
            await gate.settle(adm.limit, 0)
        if attempt.wait:
            limits = await self._live.aapply(gate.client, attempt.wait)
            try:
                decision = await gate.wait(limits, timeout=self._probe(), grace=self.grace)
            except ThrottleTimeout as exc:
                self._past_probe(await gate.stopped(limits), exc)
                decision = await gate.wait(limits, timeout=self.timeout, grace=self.grace)
        admitted = _admitted(decision)
        response = await self.inner.handle_async_request(request)
        body = await response.aread() if self._needs_body(response, attempt) else None
        for step in self._after(response, attempt, body, admitted):
            if step.op == "stop":
                await response.aclose()
            self._said(step, await getattr(gate, step.op)(*step.args, **step.options))
        return response

    async def aclose(self) -> None:
        """Close the transport that sends, and the gate made here for the running loop."""
        await self.inner.aclose()
        if self._loop_gates is not None:
            await self._loop_gates.aclose()

    def _gate(self) -> AsyncGate:
        if self.gate is not None:
            return self.gate
        assert self._loop_gates is not None  # (one of the two is required)
        return self._loop_gates.get()


def gated_client(rate: str | Rate | None = None, *, name: str | None = None, burst: int = 1,
                 key: object = None, limits: Sequence[Limit] = (), tokens: TokenQuota = None,
                 input_tokens: TokenQuota = None, output_tokens: TokenQuota = None,
                 url: str | None = None,
                 gate: Gate | None = None, prefix: str = "throttle", module: str | None = None,
                 timeout: float | None = None, follow: bool = True,
                 answers: Hook | None = None, adaptive: bool = False,
                 floor: str | Rate | None = None, **client_options: Any) -> Any:
    """A sync HTTP client whose every request waits for a start of ``rate`` under ``name``.

    For ``OpenAI(http_client=...)`` and ``Anthropic(http_client=...)``.
    ``limits``: more rate limits (or instead), e.g. per model.  ``tokens``:
    the provider's token quota (``"200000/m"``: the limit ``<name>-tokens``
    with a whole period's tokens as its burst; or a :class:`Limit`); each
    request is charged its estimate and settled from the answer's
    ``usage``.  ``input_tokens`` / ``output_tokens``: a provider's separate
    quotas, the same way (``<name>-input-tokens``...).  ``url`` and
    ``prefix``: the throttle's Redis as the workers see it (the client's
    ``close()`` closes the gate made for it), or ``gate`` (the caller's).
    ``module``: ``"httpx2"`` (the SDKs', the default when installed) or
    ``"httpx"``.  ``follow``: spend no more than the provider's headers say
    is left (default).  ``answers``: a provider's own signals, e.g. a 200 whose
    JSON says "rate limited" (``celery_throttle.answers``).  ``adaptive``:
    the provider's quota is not known: learn it below ``rate`` from its quota
    refusals, not below ``floor`` (``Limit(adaptive=True)``).
    ``client_options`` go to the client (``timeout``...).
    """
    chosen = limits_of(rate, name, burst, key, limits, adaptive, floor)  # (before any client)
    meters = token_limits(name, tokens, input_tokens, output_tokens)
    http = _http_package(module)
    own = gate is None
    if gate is None:
        if url is None:
            raise ValueError("give url (the throttle's Redis) or gate")
        gate = Gate.from_url(url, prefix=prefix)
    transport = GatedTransport(chosen, gate=gate, **meters, transport=http.HTTPTransport(),
                               timeout=timeout, follow=follow, own_gate=own,
                               answers=answers)
    return http.Client(transport=transport, **client_options)


def async_gated_client(rate: str | Rate | None = None, *, name: str | None = None,
                       burst: int = 1, key: object = None, limits: Sequence[Limit] = (),
                       tokens: TokenQuota = None, input_tokens: TokenQuota = None,
                       output_tokens: TokenQuota = None,
                       url: str | None = None, gate: AsyncGate | None = None,
                       prefix: str = "throttle", module: str | None = None,
                       timeout: float | None = None, follow: bool = True,
                       answers: Hook | None = None, adaptive: bool = False,
                       floor: str | Rate | None = None, **client_options: Any) -> Any:
    """:func:`gated_client` for ``AsyncOpenAI`` and ``AsyncAnthropic``."""
    chosen = limits_of(rate, name, burst, key, limits, adaptive, floor)
    meters = token_limits(name, tokens, input_tokens, output_tokens)
    http = _http_package(module)
    transport = AsyncGatedTransport(chosen, gate=gate, url=url, prefix=prefix, **meters,
                                    transport=http.AsyncHTTPTransport(), timeout=timeout,
                                    follow=follow, answers=answers)
    return http.AsyncClient(transport=transport, **client_options)
