"""The hooks into Celery (``integration/hooks.py``): each is plugged in, and each Celery
attribute it relies on exists in the Celery installed (this file runs in the version
matrix too: the oldest declared Celery, kombu and billiard, and the newest)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from celery import Celery, signals
from celery.worker.control import Panel

from celery_throttle import install, throttled
from celery_throttle.integration import hooks


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes
    (each of them in its owner's ``dir()``: a class's descriptor counts, whatever it gives
    on the class itself)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if name not in dir(found):
                raise AttributeError(f"{path}: {found!r} has no {name!r}")
            found = getattr(found, name)
        return found
    raise ImportError(path)


@pytest.mark.parametrize("hook", hooks.HOOKS, ids=lambda h: h.name)
def test_every_celery_attribute_a_hook_relies_on_exists(hook: hooks.Hook) -> None:
    """Each attribute a hook names resolves in the installed Celery, kombu and billiard."""
    assert hook.relies_on
    assert hook.why
    for path in hook.relies_on:
        resolve(path)  # (raises where a name is missing)


def test_resolve_fails_on_an_attribute_that_does_not_exist() -> None:
    """The check above can fail: a name Celery lacks raises instead of passing."""
    with pytest.raises(AttributeError):
        resolve("celery.app.task.Task.no_such_hook")
    with pytest.raises(ImportError):
        resolve("no_such_package.thing")


def test_every_receiver_install_connects_is_a_hooked_signal() -> None:
    """The signals ``install(app)`` connects are the ones ``HOOKS`` names, and each is
    connected; an unknown name is refused."""
    app = Celery("hooks", set_as_current=False)
    app.conf.throttle_redis_url = "redis://127.0.0.1:1/0"  # (read, never connected here)
    before = {name: len(getattr(signals, name).receivers) for name in hooks.WORKER_SIGNALS}
    install(app)
    for name in hooks.WORKER_SIGNALS:
        assert len(getattr(signals, name).receivers) == before[name] + 1, name
        assert f"celery.signals.{name}" in next(h for h in hooks.HOOKS
                                                  if h.name == "signals").relies_on
    with pytest.raises(ValueError, match="not a hooked signal: task_success"):
        hooks.connect_worker(app, {"task_success": lambda **_: None}, lambda: None)


def test_a_gated_task_has_its_run_and_strategy_hooked_once() -> None:
    """``@throttled`` wraps the task's run and names the throttle's strategy, keeping the
    task's own; wrapping again changes nothing."""
    app = Celery("hooks-run", set_as_current=False)

    @throttled(rate="1/s")
    @app.task
    def job() -> int:
        return 1

    assert job.Strategy == hooks.STRATEGY
    assert job.__dict__[hooks.ORIGINAL_STRATEGY] == "celery.worker.strategy:default"
    wrapped = job.run
    assert not hooks.wrap_run(job, lambda run: run)
    assert job.run is wrapped
    assert job(), "a direct call runs the task's function"


def test_the_revoke_command_is_wrapped_once_and_keeps_celery_s_reply() -> None:
    """Celery's ``revoke`` runs first and its reply comes back; the ids are heard after."""
    heard: list[Any] = []
    original = Panel.data["revoke"]
    try:
        Panel.data["revoke"] = lambda state, task_id, **_: {"ok": task_id}
        hooks.wrap_revoke(lambda state, ids: heard.append(ids))
        hooks.wrap_revoke(lambda state, ids: heard.append(("twice", ids)))
        assert Panel.data["revoke"](object(), "t1") == {"ok": "t1"}
        assert heard == ["t1"]
    finally:
        Panel.data["revoke"] = original
