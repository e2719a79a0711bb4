"""The web side: a Starlette app whose endpoint calls the provider under the workers' limit.

Starlette rather than FastAPI: it is what FastAPI is built on, so the same
handler works in a FastAPI app unchanged, and it needs no pydantic for one
endpoint.  Run it with ``uvicorn examples.web_api.web:app``.

Each request waits for a start of limit "provider" with ``AsyncGate.admitted``
(booked, so concurrent requests get distinct, evenly spaced starts rather
than racing), then calls the provider.  A request that would wait longer
than ``MAX_WAIT`` gets a 503 with ``Retry-After`` at once: it books nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from celery_throttle import AsyncGate, Limit, ThrottleTimeout, parse_rate
from examples.web_api.app import LIMIT_NAME, PROVIDER, RATE, THROTTLE_STORE

LIMITS = [Limit(LIMIT_NAME, parse_rate(RATE))]  # the same bucket as the task's @throttled
MAX_WAIT = 20.0  # seconds a request may wait for its start


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """One gate and one HTTP client for the process, closed at shutdown."""
    app.state.gate = AsyncGate.from_url(THROTTLE_STORE)  # the workers' prefix: "throttle"
    app.state.http = httpx.AsyncClient(base_url=PROVIDER, timeout=10)
    try:
        yield
    finally:
        await app.state.http.aclose()
        await app.state.gate.aclose()


async def summarize(request: Request) -> JSONResponse:
    """POST {"doc": ...}: the provider's answer, or 503 when the wait would be too long."""
    body: dict[str, Any] = await request.json()
    gate: AsyncGate = request.app.state.gate
    try:
        async with gate.admitted(LIMITS, timeout=MAX_WAIT):
            response = await request.app.state.http.post("/v1/summarize",
                                                         json={"prompt": body["doc"]})
    except ThrottleTimeout as exc:
        return JSONResponse({"error": str(exc)}, status_code=503,
                            headers={"Retry-After": str(math.ceil(exc.waited))})
    return JSONResponse({"provider_status": response.status_code}, status_code=200)


async def health(request: Request) -> JSONResponse:
    """For the runner: the server is up."""
    return JSONResponse({"ok": True})


app = Starlette(routes=[Route("/summarize", summarize, methods=["POST"]),
                        Route("/health", health)], lifespan=lifespan)
