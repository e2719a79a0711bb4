"""One run's state (integration/run.py): one object per request, and the two rewrites."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, cast

import pytest
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


CONTROL = {"Ignore", "Reject", "Retry"}


def ends_runs(source: str) -> list[str]:
    """The functions of ``source`` that end a run: raise Celery's control exceptions, or
    call a function that does (``carry_out``), or are typed ``NoReturn``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        returns = node.returns
        if (isinstance(returns, ast.Name) and returns.id == "NoReturn") or \
                (isinstance(returns, ast.Constant) and returns.value == "NoReturn"):
            found.append(node.name)
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Raise) and inner.exc is not None:
                called = inner.exc.func if isinstance(inner.exc, ast.Call) else inner.exc
                if getattr(called, "id", getattr(called, "attr", "")) in CONTROL:
                    found.append(node.name)
                    break
    return found


def _own_nodes(function: ast.AST) -> list[ast.AST]:
    """The nodes of ``function``'s body, not those of the functions defined in it."""
    found, todo = [], list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        found.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def test_one_function_ends_a_gated_run_early() -> None:
    """Celery's Ignore is raised by act.carry_out alone, which the gated run calls; no other
    function of the package both returns and ends a run (none is typed NoReturn)."""
    package = Path(celery_throttle.__file__).parent
    ending = []
    calling = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(package).as_posix()
        ending += [(where, name) for name in ends_runs(source)]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calling += [(where, node.name) for inner in _own_nodes(node)
                            if isinstance(inner, ast.Call)
                            and getattr(inner.func, "id", "") == "carry_out"]
    assert ending == [("integration/act.py", "carry_out")]
    assert set(calling) == {("integration/throttled.py", "gated_run")}


@pytest.mark.parametrize("source", [
    "def gone() -> NoReturn:\n    raise Left\n",
    "def end(x):\n    if x:\n        raise Ignore()\n    return 1\n",
    "def reject():\n    raise celery.exceptions.Reject('no')\n",
])
def test_the_check_finds_a_function_that_ends_a_run(source: str) -> None:
    """Fed a function that ends a run (NoReturn, or raising a control exception), the check
    above names it."""
    assert ends_runs(source) != []
