"""``celery -A proj throttle dashboard``: one web page of every limit, updated every second.

A Starlette app (the ``web`` extra) serving the page and its JSON:

* ``GET /api/status``: the document ``celery throttle status --json`` prints
  (``report.status``), read at most one sampling period (1 s) before, shared by
  every open page, and afresh after an action;
* ``GET /api/history?after=S``: the charts' seconds after ``S`` (``charts.py``);
* ``GET /api/why/{task_id}``: ``celery throttle why --json``;
* ``GET /api/meta``: whether the controls are on, the app and the store (its
  URL without the password);
* ``POST /api/limits/{name}/pause|resume|set|unset|shadow|purge`` and
  ``POST /api/purge``: the CLI's actions (``control.py``).

The controls are off unless the dashboard has a secret (``--token`` or
``CELERY_THROTTLE_DASHBOARD_TOKEN``): without one every state-changing request
is refused.  With one, a request must carry it (``Authorization: Bearer``), be
JSON, and come from the page's own origin (``Origin``, ``Sec-Fetch-Site``): a
form or script of another site can send none of these without a CORS
preflight, which this app never answers.  The page keeps the secret the
operator types in the tab's session storage; it is never in the page.  Bound
to a loopback address, only loopback host names are served (a DNS-rebinding
site cannot read the page).  Key values never appear: per-key state is shown
by key digest, as stored.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import redis
from celery import Celery
from kombu.utils.url import maybe_sanitize_url

from ..integration.config import read_config
from . import control, report
from .charts import Charts

__all__ = ["TOKEN_ENV", "create_app", "serve"]

#: The environment variable the secret may come from (kept out of the process list).
TOKEN_ENV = "CELERY_THROTTLE_DASHBOARD_TOKEN"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_MAX_ID = 200  # task ids are UUIDs; anything much longer is not one
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # No frame may hold the page (its buttons under another site's clicks), no
    # script or style but its own.
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
}


def create_app(app: Celery, *, token: str | None = None, host: str = "127.0.0.1",
               sample_every: float = 1.0) -> Any:
    """The dashboard of ``app`` as an ASGI app; ``token``: the controls' secret (None:
    read-only); ``host``: the address it is served on (loopback: loopback names only)."""
    try:
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.trustedhost import TrustedHostMiddleware
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as exc:  # pragma: no cover - the web extra is a test extra
        raise ImportError("the dashboard needs Starlette and uvicorn: "
                          "pip install 'celery-gcra-throttle[web]'") from exc
    from starlette.concurrency import run_in_threadpool

    if token is not None and len(token) < 16:
        raise ValueError("the dashboard's token is too short: use at least 16 characters "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
    charts = Charts(app)
    stop = threading.Event()
    # The last status document and when it was read (monotonic): every open page asks
    # once a second, and with many key values waiting one read costs tens of ms or
    # more, so pages share a read at most one sampling period old (an action drops it).
    latest: dict[str, Any] = {"actions": 0}
    latest_lock = threading.Lock()

    def read(how: Any) -> dict[str, Any]:
        """Read the document with ``how`` and keep it, unless an action ended meanwhile."""
        with latest_lock:
            actions = latest["actions"]
        doc: dict[str, Any] = how()
        with latest_lock:
            if latest["actions"] == actions:
                latest.update(doc=doc, at=time.monotonic())
        return doc

    def current_status() -> dict[str, Any]:
        with latest_lock:
            if "doc" in latest and time.monotonic() - latest["at"] < sample_every:
                return dict(latest["doc"])
        return read(lambda: report.status(app))

    def sampler() -> None:
        while not stop.wait(sample_every):
            try:
                read(charts.sample)
            except Exception:  # (a store outage shows on the page's next read)
                continue

    def answer(body: Any, status: int = 200) -> Response:
        return JSONResponse(body, status_code=status, headers=_HEADERS)

    def refused(status: int, message: str) -> Response:
        return answer({"error": message}, status)

    async def page(request: Request) -> Response:
        name = "dashboard.js" if request.url.path.endswith(".js") else "page.html"
        text = resources.files(__package__).joinpath("web").joinpath(name).read_text("utf-8")
        kind = "text/javascript" if name.endswith(".js") else "text/html"
        return Response(text, media_type=kind, headers=_HEADERS)

    async def status(request: Request) -> Response:
        return await guarded(current_status)

    async def history(request: Request) -> Response:
        after = request.query_params.get("after")
        try:
            since = None if after in (None, "") else int(after)
        except ValueError:
            return refused(400, f"after={after!r}: expected a unix second")
        return await guarded(charts.since, since)

    async def why(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        if not task_id.strip() or len(task_id) > _MAX_ID:
            return refused(400, f"{task_id[:_MAX_ID]!r}: not a task id")
        return await guarded(report.why, app, task_id)

    async def meta(request: Request) -> Response:
        config = read_config(app)
        return answer({"app": app.main or "", "controls": token is not None,
                       "store": maybe_sanitize_url(config.redis_url),
                       "prefix": config.prefix, "span_s": charts.span})

    async def act(request: Request) -> Response:
        why_not = _write_refusal(request, token)
        if why_not is not None:
            return refused(*why_not)
        try:
            body = await request.json()
        except ValueError:
            return refused(400, "the body is not JSON")
        if not isinstance(body, dict):
            return refused(400, "the body is not a JSON object")
        action = request.path_params.get("action", "purge")
        name = request.path_params.get("name", "")
        try:
            call = _action(app, action, name, body)
        except control.BadValue as exc:
            return refused(400, str(exc))

        def acted() -> Any:
            try:
                return call()
            finally:
                with latest_lock:  # the next page read shows what the action did
                    latest.pop("doc", None)
                    latest["actions"] += 1
        return await guarded(acted)

    async def guarded(fn: Any, *args: Any) -> Response:
        try:
            return answer(await run_in_threadpool(fn, *args))
        except report.UnknownLimit as exc:
            return refused(404, str(exc))
        except (control.BadValue, control.NeedsKey) as exc:
            return refused(400, str(exc))
        except redis.RedisError as exc:
            return refused(503, f"the throttle store did not answer ({type(exc).__name__})")

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        threading.Thread(target=sampler, daemon=True, name="celery_throttle-sampler").start()
        try:
            yield
        finally:
            stop.set()

    hosts = [h for h in _LOOPBACK] if host in _LOOPBACK else ["*"]
    return Starlette(
        routes=[Route("/", page), Route("/dashboard.js", page),
                Route("/api/status", status), Route("/api/history", history),
                Route("/api/why/{task_id:path}", why), Route("/api/meta", meta),
                Route("/api/limits/{name:path}/{action}", act, methods=["POST"]),
                Route("/api/purge", act, methods=["POST"])],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts)],
        lifespan=lifespan)


def _write_refusal(request: Any, token: str | None) -> tuple[int, str] | None:
    """Why a state-changing request is refused (status, message), or None."""
    if token is None:
        return 403, (f"read-only: the dashboard was started without a secret (--token or "
                     f"{TOKEN_ENV})")
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return 403, f"refused: a {site} request"
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.headers.get('host')}":
        return 403, "refused: a request from another origin"
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return 415, "expected a JSON body (Content-Type: application/json)"
    given = request.headers.get("authorization", "")
    if not given.startswith("Bearer ") or not hmac.compare_digest(
            given[len("Bearer "):].encode(), token.encode()):
        return 401, "the secret is missing or wrong"
    return None


def _action(app: Celery, action: str, name: str, body: dict[str, Any]) -> Any:
    """The call that does ``action`` on limit ``name`` with ``body``'s fields, checked."""
    key = body.get("key")
    if key is not None and not isinstance(key, str):
        raise control.BadValue(f"{key!r}: a key value is a string", "key")
    if action == "pause":
        seconds = body.get("seconds")
        if seconds is not None and (isinstance(seconds, bool)
                                    or not isinstance(seconds, int | float)):
            raise control.BadValue(f"{seconds!r}: expected seconds", "seconds")
        return lambda: {"paused_s": control.pause(app, name, seconds, key)}
    if action == "resume":
        return lambda: {"resumed": control.resume(app, name, key)}
    if action == "set":
        rate, burst = body.get("rate"), body.get("burst")
        if not isinstance(rate, str):
            raise control.BadValue(f"{rate!r}: expected a rate such as '20/s'", "rate")
        if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int)):
            raise control.BadValue(f"{burst!r}: expected a whole number", "burst")

        def set_it() -> dict[str, Any]:
            parsed, used, _ = control.set_rate(app, name, rate, burst)
            return {"rate": str(parsed), "burst": used}
        return set_it
    if action == "purge" and name:
        if body.get("confirm") != name:
            raise control.BadValue(f"revoking the tasks waiting for {name!r} cannot be undone: "
                                   f"send {{\"confirm\": {json.dumps(name)}}}", "confirm")
        return lambda: {"revoked": control.revoke_waiting(app, name)}
    if action == "shadow":
        mode = body.get("mode")
        if mode not in ("on", "off", "unset"):
            raise control.BadValue(f"{mode!r}: expected on, off or unset", "mode")
        return lambda: {"enforced": control.shadow(app, name, str(mode))[0]}
    if action == "unset":
        return lambda: {"had_a_rate_set": control.unset_rate(app, name)[0]}
    if action == "purge" and not name:
        if body.get("confirm") != "purge":
            raise control.BadValue('a purge drops every waiting task: send {"confirm": '
                                   '"purge"}', "confirm")

        def purge() -> dict[str, Any]:
            done = control.purge(app)
            return {"dropped": done.dropped, "revoked": done.revoked}
        return purge
    raise control.BadValue(f"{action!r}: expected pause, resume, set, unset, shadow or purge",
                           "action")


def serve(app: Celery, host: str, port: int, token: str | None) -> None:
    """Run the dashboard until interrupted."""
    try:
        import uvicorn
    except ImportError as exc:  # pragma: no cover
        raise ImportError("the dashboard needs Starlette and uvicorn: "
                          "pip install 'celery-gcra-throttle[web]'") from exc
    uvicorn.run(create_app(app, token=token, host=host), host=host, port=port,
                log_level="warning")

