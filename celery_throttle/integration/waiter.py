"""The task a waiting copy carries, as the ways to wait read it, in a pool run or before one.

A pool process reads it from the run's request (:meth:`Waiter.of_run`); the
worker's main process, lining a fresh message up before any pool process
runs it (``arrival.py``), reads it from the message (:meth:`Waiter.of_message`)
and sends its events through the consumer's own dispatcher: neither pretends
to be the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import Task

__all__ = ["Waiter"]


@dataclass(frozen=True, slots=True)
class Waiter:
    """One task's copy that may wait: ``id``, ``retries``, Celery ``priority`` (None: none),
    ``expires`` (as Celery carries it), ``ignore_result``, ``request`` (what the result
    backend records beside a state: the run's request, or before a run the message's
    fields as Celery's request holds them), and ``send_event`` (a task event about it:
    ``send_event(type, **fields)``; None: the worker sends none)."""

    task: Task[Any, Any]
    id: str
    retries: Any = 0  # (as Celery's request carries it: the copy pointer's key holds it)
    priority: int | None = None
    expires: Any = None
    ignore_result: bool = False
    request: Any = None
    send_event: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        """The task's name."""
        return str(self.task.name)

    @classmethod
    def of_run(cls, task: Task[Any, Any]) -> Waiter:
        """The copy the running task's request carries (a pool process's run)."""
        request = task.request
        raw = (request.delivery_info or {}).get("priority")
        events = task.app.conf.worker_send_task_events
        return cls(task, str(request.id), request.retries,
                   raw if isinstance(raw, int) else None, getattr(request, "expires", None),
                   bool(getattr(request, "ignore_result", False)), request,
                   task.send_event if events else None)

    @classmethod
    def of_message(cls, task: Task[Any, Any], headers: Mapping[str, Any],
                   properties: Mapping[str, Any], request: Any,
                   send_event: Callable[..., Any] | None = None) -> Waiter:
        """A fresh message of ``task`` in the worker's main process (Celery's protocol 2:
        the id, retries and expiry in its headers, the priority in its properties);
        ``request``: its fields as Celery's request holds them, for the result backend."""
        raw = properties.get("priority")
        return cls(task, str(headers["id"]), headers.get("retries", 0),
                   raw if isinstance(raw, int) else None, headers.get("expires"),
                   bool(headers.get("ignore_result")), request, send_event)
