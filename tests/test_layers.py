"""The package's imports run one way (STYLE.md): no module imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "celery_throttle"


def _imports() -> dict[str, set[str]]:
    """Each module's imports of sibling modules, lazy ones inside functions included."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [
                    a.name for a in node.names]
                found |= {n for n in names if n in modules and n != path.stem}
        graph[path.stem] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def test_the_package_has_no_import_circle() -> None:
    """No import circle among the package's modules, lazy imports included."""
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check itself: a made-up a -> b -> c -> a is reported."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_leaves_import_nothing_from_the_package() -> None:
    """rates, keys, errors, values, metrics and faults sit at the bottom: no sibling imports."""
    graph = _imports()
    leaves = ("rates", "keys", "errors", "values", "metrics", "faults")
    assert {name: graph[name] for name in leaves} == {name: set() for name in leaves}


# Every piece of process-wide state in the package, and why it is one: a new
# module-level variable fails the test below until it is named here.
PROCESS_STATE = {
    "faults._hooks": "fault hooks a test's worker registered",
    "leases._heartbeat": "one thread per process renews the leases its runs hold",
    "memory._frozen": "this pool process froze what it inherited",
    "memory._pending": "a deferral left garbage for the next run to collect",
    "metrics._lock": "the counts below are updated from the threads pool's threads",
    "metrics._stats": "this process's counts per limit (what snapshot() reads)",
    "metrics._prom": "the Prometheus metrics: one registry per process",
    "store._cache": "each app's runtime (settings, client) in this process, weakly keyed",
    "store._lock": "the threads pool may build a runtime concurrently",
    "task._shared_specs": "@throttled on shared tasks, by task name: each app's copy gets them",
}


def test_process_wide_state_is_all_named() -> None:
    """Module-level mutable state is the list above (lower-case, underscored module globals;
    constants are upper-case): nothing hidden, each with its reason."""
    found = set()
    for path in PACKAGE.glob("*.py"):
        for stmt in ast.parse(path.read_text()).body:
            targets = ([t for t in stmt.targets if isinstance(t, ast.Name)]
                       if isinstance(stmt, ast.Assign) else
                       [stmt.target] if isinstance(stmt, ast.AnnAssign)
                       and isinstance(stmt.target, ast.Name) else [])
            found |= {f"{path.stem}.{t.id}" for t in targets
                      if t.id.startswith("_") and not t.id.startswith("__") and not t.id.isupper()}
    assert found == set(PROCESS_STATE)


def test_no_module_imports_a_private_name_of_another() -> None:
    """`from .x import _name` across modules is a rule living in the wrong place: none."""
    private = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
