"""Revocations heard as they arrive: a revoked task that waits leaves the waiting room at once.

Celery's ``revoke`` remote control command (``app.control.revoke``,
``AsyncResult.revoke``) reaches every worker node's main process, which
adds the ids to the node's revoked set: a message of a revoked task that
reaches the node later is dropped.  A task waiting in a limit's line sends
no message until its turn, which behind a backlog is hours away: until
then ``AsyncResult.get()`` waits, and at its turn a revoked task not yet
looked at would take the limit's start.  So the command is wrapped, once
per process: Celery's own runs first and its reply is returned as it is,
then each listener of the app (the node's dispatcher) is handed the ids.

The wrapper is ``hooks.wrap_revoke``.  Revocations by stamped headers are
not seen here: those tasks leave when their turn comes, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.utils.functional import maybe_list

from ..core.logs import logger
from . import hooks

__all__ = ["listen", "unlisten"]

Listener = Callable[[list[str]], None]

# id(app) -> the listeners of that app's revocations (a worker process has one app).
_listeners: dict[int, list[Listener]] = {}


def listen(app: Celery, listener: Listener) -> None:
    """Hand ``listener`` the task ids of every revoke command ``app``'s node receives."""
    hooks.wrap_revoke(_heard)
    _listeners.setdefault(id(app), []).append(listener)


def unlisten(app: Celery, listener: Listener) -> None:
    """Stop handing ``listener`` the revoked ids (the node shuts down)."""
    found = _listeners.get(id(app), [])
    if listener in found:
        found.remove(listener)


def _heard(state: Any, ids: Any) -> None:
    """Hand the ids of a revoke command the node ran to its app's listeners."""
    revoked = [str(i) for i in maybe_list(ids) or [] if i]
    for listener in list(_listeners.get(id(getattr(state, "app", None)), ())):
        try:
            listener(revoked)
        except Exception as exc:  # Celery's revoke is done; ours is an extra
            logger.warning("celery_throttle: a revocation not passed on: %s: %s",
                           type(exc).__name__, exc)
