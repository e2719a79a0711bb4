"""The suite's own shape: where a test goes is visible from the tree, and the marker follows it.

* ``tests/unit/``: a module's behaviour, on real servers but with no worker
  process;
* ``tests/e2e/``: end to end with real Celery worker processes, every module
  marked ``integration`` as a whole;
* ``tests/project/``: checks of the project itself (docs, layers, versions,
  this layout);
* ``tests/*.py``: the helpers they share (servers, workers, the test app).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
FOLDERS = ("unit", "e2e", "project")
# What starts real worker processes (tests/workers.py, celery_throttle.testing).
_STARTERS = {"worker_nodes", "workers", "WorkerProcess", "stack"}


def _module_marked(tree: ast.Module) -> bool:
    return any(isinstance(s, ast.Assign) and "pytestmark" in ast.unparse(s)
               and "integration" in ast.unparse(s.value) for s in tree.body)


def _starts_workers(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
               and n.func.id in _STARTERS for n in ast.walk(fn))


def _misplaced(folder: str, tree: ast.Module) -> list[str]:
    """What is wrong with a test module in ``folder``: an unmarked e2e module, or a test
    elsewhere that starts workers."""
    if folder == "e2e":
        return [] if _module_marked(tree) else ["not marked integration as a whole"]
    return [fn.name for fn in tree.body if isinstance(fn, ast.FunctionDef)
            and fn.name.startswith("test_") and _starts_workers(fn)
            and not (folder == "project" and _module_marked(tree))]


def test_every_test_module_is_in_a_folder_of_its_kind() -> None:
    """No test module sits among the helpers: each is in unit/, e2e/ or project/."""
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []
    assert sorted({p.parent.name for p in TESTS.rglob("test_*.py")}) == sorted(FOLDERS)


def test_only_the_marked_folders_start_workers() -> None:
    """`pytest -m 'not integration'` starts no worker: e2e modules are marked whole, and no
    unit test starts one."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((TESTS / folder).glob("test_*.py")):
            wrong = _misplaced(folder, ast.parse(path.read_text()))
            if wrong:
                found[f"{folder}/{path.name}"] = wrong
    assert found == {}


def test_the_check_finds_a_misplaced_test() -> None:
    """Negative control: a unit test calling worker_nodes(), an unmarked e2e module."""
    tree = ast.parse("def test_x():\n    with worker_nodes(url, ('w1',)):\n        pass\n")
    assert _misplaced("unit", tree) == ["test_x"]
    assert _misplaced("e2e", tree) == ["not marked integration as a whole"]
