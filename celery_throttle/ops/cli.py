"""``celery -A proj throttle ...``: see every limit's state, why a task waits, reset a bucket.

Registered as a Celery extension command (the ``celery.commands`` entry point
in ``pyproject.toml``), so it runs with the app and settings of ``-A proj``:

* ``status [NAME ...] [--key K] [--json]``: each known limit with its rate,
  burst, fill, next free start (and why, when paused or held back by a
  provider's rate-limit headers) and the starts booked ahead (tasks waiting);
* ``why TASK_ID [--json]``: the limit a deferred task waits for, its booked
  booked start and deferral count (recorded at each deferral, kept until the booked start);
* ``reset NAME [--key K]``: forget a bucket (it is full again);
* ``set NAME RATE [--burst N]`` / ``unset NAME``: a rate set at run time over
  the code's, used by every worker and dispatcher within a second, waiting
  tasks included (``core/live.py``);
* ``shadow NAME on|off|unset``: shadow mode at run time (decided and counted,
  never waited for), over the code's ``enforce=`` and ``throttle_enforce``;
* ``pause NAME [--for S] [--key K]`` / ``resume NAME [--key K]``: admit
  nothing (the pause a provider's 429 writes), or end a pause now;
* ``parked [--limit NAME] [-n N]``: the tasks parked in the waiting room or in line
  that are dispatched next;
* ``purge --yes [--limit NAME]``: drop every waiting task (they never run; the
  result backend marks them REVOKED), or revoke those waiting for one limit;
* ``dashboard [--host H] [--port P] [--token T]``: the same on one web page,
  updated every second, with charts of the last 15 minutes; the actions above
  only with a secret (``dashboard.py``).

Per-key buckets are never listed (that would need a key scan, and key values
are stored hashed): name one with ``--key`` (``--int-key`` for integer keys).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
import redis
from celery import Celery
from kombu.utils.url import maybe_sanitize_url

from ..integration.config import read_config
from ..integration.runtime import runtime_for
from ..room.envelope import Envelope
from . import control, report
from .dashboard import TOKEN_ENV, serve

__all__ = ["throttle"]


def _app(ctx: click.Context) -> Celery:
    app: Celery = ctx.obj.app
    app.loader.import_default_modules()  # the task modules, so their limits are known
    return app


def _key_value(key: str | None, int_key: str | None) -> object:
    if key is not None and int_key is not None:
        raise click.UsageError("give --key or --int-key, not both")
    if int_key is not None:
        try:
            return int(int_key)
        except ValueError:
            raise click.BadParameter(f"{int_key!r} is not an integer",
                                     param_hint="--int-key") from None
    return key


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["LIMIT", "RATE", "BURST", "FILL", "NEXT FREE", "WAITING", "USED BY"]
    body = []
    for r in rows:
        if "concurrency" in r:  # a concurrency limit: seats held, in the same columns
            if "held" in r:
                fill = f"{r['held']}/{r['concurrency']} held"
                free = (f"paused {r['paused_s']:.3f}s{_by(r)}" if r["paused_s"] else
                        "now" if r["held"] < r["concurrency"] else "when one ends")
            else:
                fill, free = "-", r["note"] or "-"
            body.append([r["limit"] + (" (per key)" if r["per_key"] else ""),
                         f"{r['concurrency']} at once", "-", fill, free, "-",
                         ", ".join(r["used_by"])])
            continue
        if "fill" in r:
            fill, free = f"{r['fill']:.0%}", "now" if r["next_free_s"] == 0 else \
                f"in {r['next_free_s']:.3f}s" + (f" (paused{_by(r)})" if r["paused_s"] else "")
            if held := r.get("held_by_provider"):
                free += (f" (held: the provider reported {held['remaining']} left until its "
                         f"reset in {held['until_reset_s']:.1f}s)")
            waiting = str(r["booked_ahead"])
        else:
            fill, free, waiting = "-", r["note"] or "-", "-"
        if r.get("in_line"):
            waiting = (f"{r['in_line']} in line" + (f", drains in ~{_span(r['drains_in_s'])}"
                                                     if r["drains_in_s"] is not None else "")
                       + (f" (+{r['booked_ahead']} booked)" if r.get("booked_ahead") else ""))
        rate = r["rate"] + (f" (set; code {r['code_rate']} burst {r['code_burst']})"
                            if "code_rate" in r else "") + _learned(r)
        if shadow := r.get("shadow"):  # shadow mode: what it would have done
            waiting = (f"none (shadow: would have deferred {shadow['would_defer_15m']} in 15m"
                       + (f", would drain in {_span(shadow['would_next_free_s'])}"
                          if shadow.get("would_next_free_s") else "") + ")")
        body.append([r["limit"] + (" (per key)" if r["per_key"] else "")
                     + ("" if r.get("enforced", True) else " (shadow)"), rate,
                     str(r["burst"]), fill, free, waiting, ", ".join(r["used_by"])])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in [head, *body]]
    return "\n".join(lines)


def _learned(row: dict[str, Any]) -> str:
    """What a limit that learns its rate learned, as a few words."""
    if (learned := row.get("learned")) is None:
        return ""
    said = f", learned {learned['rate_per_s']:.4g}/s"
    if learned["moved"]:
        said += (f" ({learned['moved']} {_span(learned['moved_s_ago'])} ago from "
                 f"{learned['before_per_s']:.4g}/s)")
    return said


def _by(row: dict[str, Any]) -> str:
    """Who paused the limit of ``row``, as a few words."""
    if stopped := row.get("stopped"):
        return (f": stopped until resumed, the provider says the money is spent "
                f"({stopped['message']!r})")
    return {"operator": " by an operator", "provider": " after a provider's 429"}.get(
        row.get("paused_by", ""), "")


def _span(seconds: float) -> str:
    """A duration as 2h47m, 3m05s or 12.5s."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.1f}s"


class _Commands(click.Group):
    """The throttle commands: a store that does not answer is one line and a non-zero exit."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except report.UnknownLimit as exc:
            raise click.BadParameter(str(exc), param_hint="NAME") from None
        except control.BadValue as exc:
            raise click.BadParameter(str(exc), param_hint=exc.param) from None
        except control.NeedsKey as exc:
            raise click.UsageError(str(exc)) from None
        except redis.RedisError as exc:
            # The URL without its password; the exception's text names host
            # and port, never the password.
            url = maybe_sanitize_url(read_config(ctx.obj.app).redis_url)
            raise click.ClickException(
                f"the throttle store {url} did not answer ({type(exc).__name__}: {exc}); "
                "it is set by throttle_redis_url (default: broker_url)") from None


@click.group(name="throttle", cls=_Commands)
def throttle() -> None:
    """Inspect and reset celery_throttle limits (the app's throttle_* settings apply)."""


@throttle.command()
@click.argument("names", nargs=-1)
@click.option("--key", help="a string key value of per-key limits (hashed, never stored)")
@click.option("--int-key", help="an integer key value of per-key limits")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of a table")
@click.pass_context
def status(ctx: click.Context, names: tuple[str, ...], key: str | None, int_key: str | None,
           as_json: bool) -> None:
    """Each limit: rate, burst, fill, next free start, starts booked ahead (tasks waiting)."""
    doc = report.status(_app(ctx), names, _key_value(key, int_key))
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    rows, room = doc["limits"], doc["waiting_room"]
    click.echo(_table(rows))
    in_line, judged = doc["in_line"], room["because"] != report.ROOM_OFF
    if room["parked"] or room["dispatching"] or in_line or judged:
        nxt = (f"; next dispatch in {room['next_dispatch']:.3f}s"
               if room["next_dispatch"] is not None else "")
        click.echo(f"waiting room: {room['parked']} parked, {in_line} in line, "
                   f"{room['dispatching']} dispatched and on their way{nxt}")
    if room["kept"]:
        click.echo(f"  {room['kept']} of them kept beside the broker's queues too (restored "
                   "from there if the store comes back empty)")
    if room["kept_beside_broker"]:
        click.echo(f"waiting room in use: {room['because']}")
    if judged and not room["in_use"]:
        click.echo(f"waiting room not used: {room['because']}; long waits are re-published "
                   "with a countdown")


@throttle.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of text")
@click.pass_context
def why(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why TASK_ID waits: its limit, booked start and deferrals (from its last deferral)."""
    doc = report.why(_app(ctx), task_id)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    wait = doc["waiting"]
    if wait is None:
        click.echo(f"task {task_id}: not waiting for the throttle (no deferral recorded in "
                   "the last wait; it may have started, or never been deferred)")
        return
    due = wait["due_in_s"]
    when = f"in {due:.3f}s" if due >= 0 else f"{-due:.3f}s ago (started, or deciding again)"
    parked = ""
    if wait.get("entry"):
        place = wait.get("place")
        parked = (f" is number {place + 1} in line" if place is not None else
                  " left its line (dispatched)") + " and"
        when = f"estimated {when}" if due >= 0 else when
    again = " was run again after its node died, and" if wait.get("rerun") else ""
    click.echo(f"task {task_id} ({wait['task']}){again}{parked} waits for limit "
               f"{wait['limit']!r}: "
               f"next start {when}; deferral {wait['deferrals']}, waiting "
               f"{wait['waiting_s']:.1f}s so far"
               + ("; start booked" if wait["booked"] else
                  "; no start booked (its turn comes when the limit admits it)" if wait.get("entry")
                  else "; no start booked (a seat is awaited, the wait is beyond the "
                  "horizon, or the store was down)"))


@throttle.command()
@click.argument("name")
@click.option("--key", help="a string key value of a per-key limit")
@click.option("--int-key", help="an integer key value of a per-key limit")
@click.pass_context
def reset(ctx: click.Context, name: str, key: str | None, int_key: str | None) -> None:
    """Forget limit NAME's bucket (for one key value with --key): it is full again.

    For a concurrency limit, every lease and its pause are dropped: running
    tasks keep running, and new ones may start next to them.
    """
    for what, existed, keyed in control.reset(_app(ctx), name, _key_value(key, int_key)):
        click.echo(f"limit {name!r}{' (that key)' if keyed else ''}: "
                   + (f"{what} reset" if existed else f"{what} already empty"))


@throttle.command()
@click.option("--limit", "limit_name", help="only tasks waiting for this limit")
@click.option("-n", "count", default=20, show_default=True, help="how many to list")
@click.option("--json", "as_json", is_flag=True, help="one JSON document instead of text")
@click.pass_context
def parked(ctx: click.Context, limit_name: str | None, count: int, as_json: bool) -> None:
    """The tasks waiting in the waiting room that go next: parked (soonest dispatch first),
    and in line (the heads of the limits' lines)."""
    if count < 1:
        raise click.BadParameter(f"{count}: expected at least 1", param_hint="-n")
    room = runtime_for(_app(ctx)).room
    rows = []
    # With --limit, look further than -n: other limits' tasks are skipped.
    for item in room.next_parked(count if limit_name is None else max(count, 1000)):
        headers = _headers(item.message)
        note = json.loads(item.note) if item.note else {}
        limit = note.get("limit", "?")
        if limit_name is not None and limit != limit_name:
            continue
        rows.append({"task": headers.get("task", "?"), "id": headers.get("id", "?"),
                     "limit": limit, "dispatch_in_s": round(item.dispatch_in, 3)})
        if len(rows) == count:
            break
    line = [{"task": (h := _headers(t.message)).get("task", "?"), "id": h.get("id", "?"),
             "limit": t.limit, "key_digest": t.key_digest, "place": t.place}
            for t in room.lines.next_in_line(count, limit_name)]
    if as_json:
        click.echo(json.dumps({"parked": rows, "in_line": line, "at": time.time()}, indent=2))
        return
    if not rows and not line:
        click.echo("no task waiting" + (f" for limit {limit_name!r}" if limit_name else ""))
    for row in rows:
        click.echo(f"{row['task']}[{row['id']}] waits for limit {row['limit']!r}: "
                   f"dispatched in {row['dispatch_in_s']:.3f}s")
    for row in line:
        key = "" if row["key_digest"] == "-" else f" (key {row['key_digest']})"
        click.echo(f"{row['task']}[{row['id']}] waits in line for limit {row['limit']!r}"
                   f"{key}: place {row['place']}")


def _headers(message: bytes) -> dict[str, Any]:
    """A stored message's Celery headers ({} if it cannot be read)."""
    try:
        return Envelope.loads(message).headers
    except (ValueError, KeyError):
        return {}


@throttle.command()
@click.option("--yes", is_flag=True, help="really drop them")
@click.option("--limit", "limit_name", help="only the tasks waiting for this limit (revoked)")
@click.pass_context
def purge(ctx: click.Context, yes: bool, limit_name: str | None) -> None:
    """Drop every task waiting in the waiting room: they will never run.

    With --limit, only the tasks waiting for that limit: they are revoked
    (every worker drops them; the limit is free at once).  Without --yes
    nothing is dropped: the count is shown and the exit code is 2.
    """
    app = _app(ctx)
    if not yes:
        what = (f"the tasks waiting for limit {limit_name!r}" if limit_name else
                f"{control.waiting(app)} waiting task(s)")
        click.echo(f"would drop {what}; add --yes to drop them (they will never run)")
        ctx.exit(2)
    if limit_name is not None:
        revoked = control.revoke_waiting(app, limit_name)
        click.echo(f"revoked {revoked} task(s) waiting for limit {limit_name!r}")
        return
    done = control.purge(app)
    click.echo(f"dropped {done.dropped} waiting task(s)"
               + (f"; {done.revoked} marked REVOKED in the result backend" if done.revoked
                  else ""))


@throttle.command(name="set")
@click.argument("name")
@click.argument("rate")
@click.option("--burst", type=int, default=None, help="the burst (default: the code's)")
@click.pass_context
def set_(ctx: click.Context, name: str, rate: str, burst: int | None) -> None:
    """Set limit NAME to RATE (e.g. 20/s) everywhere within a second, over the code's.

    Every worker's next decision and every dispatcher use it, for the tasks
    already waiting too, until ``unset``; it names the limit, so it applies
    to every key value of a per-key limit.
    """
    parsed, burst, limit = control.set_rate(_app(ctx), name, rate, burst)
    click.echo(f"limit {name!r}: {parsed} burst {burst} (set; the code says {limit.rate} "
               f"burst {limit.burst}); every worker uses it within a second")


@throttle.command()
@click.argument("name")
@click.pass_context
def unset(ctx: click.Context, name: str) -> None:
    """Back to the code's rate for limit NAME (undo ``set``)."""
    had, limit = control.unset_rate(_app(ctx), name)
    click.echo(f"limit {name!r}: {limit.rate} burst {limit.burst} (the code's)"
               + ("" if had else "; it had no rate set"))


@throttle.command()
@click.argument("name")
@click.argument("mode", type=click.Choice(["on", "off", "unset"]))
@click.pass_context
def shadow(ctx: click.Context, name: str, mode: str) -> None:
    """Shadow mode for limit NAME: on (decided and counted, never waited for), off
    (enforced), or unset (as the code and throttle_enforce say), everywhere within a second.
    """
    now, had = control.shadow(_app(ctx), name, mode)
    click.echo(f"limit {name!r}: " + ("back to the code's and the app's choice" if now is None
                                      else "enforced" if now else "in shadow mode (counted, "
                                      "never waited for)")
               + ("" if had or now is not None else "; it had no switch set"))


@throttle.command()
@click.argument("name")
@click.option("--for", "seconds", type=float, default=None,
              help="seconds (default: until resume, at most 7 days)")
@click.option("--key", help="a string key value of a per-key limit")
@click.option("--int-key", help="an integer key value of a per-key limit")
@click.pass_context
def pause(ctx: click.Context, name: str, seconds: float | None, key: str | None,
          int_key: str | None) -> None:
    """Admit nothing in limit NAME (the pause a provider's 429 writes) until ``resume``."""
    lasts = control.pause(_app(ctx), name, seconds, _key_value(key, int_key))
    click.echo(f"limit {name!r}: paused for {lasts:.0f}s"
               + (" (until resume)" if seconds is None else ""))


@throttle.command()
@click.argument("name")
@click.option("--key", help="a string key value of a per-key limit")
@click.option("--int-key", help="an integer key value of a per-key limit")
@click.pass_context
def resume(ctx: click.Context, name: str, key: str | None, int_key: str | None) -> None:
    """End a pause of limit NAME now (set by ``pause`` or by a provider's 429)."""
    ended = control.resume(_app(ctx), name, _key_value(key, int_key))
    click.echo(f"limit {name!r}: " + ("resumed" if ended else "was not paused"))


@throttle.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="the address to serve on (another than loopback shows the page to the network)")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(1, 65535))
@click.option("--token", envvar=TOKEN_ENV, default=None, show_envvar=True,
              help="the secret that turns the controls on (pause, resume, set, unset, purge); "
                   "without it the page is read-only. Prefer the environment variable: "
                   "a command line is visible to other users")
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int, token: str | None) -> None:
    """Serve a web page of every limit (status, charts, why, controls) until interrupted."""
    app = _app(ctx)
    click.echo(f"celery_throttle dashboard on http://{host}:{port}/ "
               + ("(controls on: requests need the secret)" if token else "(read-only)"))
    try:
        serve(app, host, port, token or None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--token") from None
