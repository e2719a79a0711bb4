"""One run's state (integration/run.py): one object per request, and the two rewrites."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, cast

from celery import Celery

import celery_throttle
from celery_throttle.integration.run import Run, rewrite, run_of, start_run
from celery_throttle.integration.runtime import Runtime
from celery_throttle.room.header import HEADER


def _request(app: Celery, **fields: Any) -> Any:
    @app.task(name="run_state_job", shared=False)
    def job() -> None:
        return None

    job.push_request(id="t-1", called_directly=False, **fields)
    return job.request


def test_a_request_without_an_admission_has_no_run() -> None:
    app = Celery("run-none", set_as_current=False)
    request = _request(app, delivery_info={}, headers=None)
    assert run_of(request) is None
    assert run_of(None) is None


def test_a_new_admission_replaces_the_earlier_run() -> None:
    app = Celery("run-new", set_as_current=False)
    runtime = cast(Runtime, object())  # (only carried: the run never calls it here)
    request = _request(app, delivery_info={}, headers=None)
    first = start_run(request, runtime)
    first.late = 0.2
    assert run_of(request) is first
    second = start_run(request, runtime)
    assert run_of(request) is second
    assert (second.late, second.started, second.leased, second.admitted) == (0.0, None, None,
                                                                             None)
    assert isinstance(second, Run)
    assert second.runtime is runtime


def test_rewrite_writes_only_what_it_is_given() -> None:
    app = Celery("run-rewrite", set_as_current=False)
    request = _request(app, delivery_info={"exchange": "", "routing_key": "lane", "priority": 3},
                       headers={"other": "kept"})
    rewrite(request, routing_key="celery")
    assert request.delivery_info == {"exchange": "", "routing_key": "celery", "priority": 3}
    assert request.headers == {"other": "kept"}
    rewrite(request, header={"deferrals": 2})
    assert request.headers == {"other": "kept", HEADER: {"deferrals": 2}}
    assert request.delivery_info["routing_key"] == "celery"


def test_rewrite_on_a_request_with_nothing_yet() -> None:
    app = Celery("run-empty", set_as_current=False)
    request = _request(app, delivery_info=None, headers=None)
    rewrite(request, routing_key="q", header={"deferrals": 1})
    assert request.delivery_info == {"routing_key": "q"}
    assert request.headers == {HEADER: {"deferrals": 1}}


def test_only_the_gated_run_raises_celerys_control_exceptions() -> None:
    """The ways out raise exits.Left; the gated run alone turns it into Celery's Ignore."""
    package = Path(celery_throttle.__file__).parent
    raised = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Raise) and inner.exc is not None:
                        called = inner.exc.func if isinstance(inner.exc, ast.Call) else inner.exc
                        name = getattr(called, "id", getattr(called, "attr", ""))
                        if name in {"Ignore", "Reject", "Retry"}:
                            raised.append((path.relative_to(package).as_posix(), node.name))
    assert raised == [("integration/throttled.py", "_end_run")]
