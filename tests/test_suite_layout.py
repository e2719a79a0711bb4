"""The suite's own shape: every test that starts worker processes carries the marker."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# What starts real worker processes (tests/workers.py, celery_throttle.testing).
_STARTERS = {"cluster", "workers", "WorkerProcess", "stack"}


def _marked(decorators: list[ast.expr]) -> bool:
    return any("integration" in ast.unparse(d) for d in decorators)


def _starts_workers(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
               and n.func.id in _STARTERS for n in ast.walk(fn))


def test_every_test_that_starts_workers_is_marked_integration() -> None:
    """`pytest -m 'not integration'` really starts no worker (the marker is the contract)."""
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(s, ast.Assign) and "pytestmark" in ast.unparse(s)
                            and "integration" in ast.unparse(s.value) for s in tree.body)
        for fn in tree.body:
            if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")
                    and _starts_workers(fn) and not (module_marked or _marked(fn.decorator_list))):
                unmarked.append(f"{path.name}::{fn.name}")
    assert not unmarked, unmarked


def test_the_check_finds_an_unmarked_worker_test() -> None:
    """Negative control: a made-up test calling cluster() without the marker is found."""
    fn = ast.parse("def test_x():\n    with cluster(url, ('w1',)):\n        pass\n").body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _starts_workers(fn)
    assert not _marked(fn.decorator_list)
