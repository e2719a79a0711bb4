"""The package's layers: imports run one way, from the leaves up, and the core needs no Celery."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_throttle"

# Each layer may import the layers below it, never one above (not even
# lazily, inside a function).  A folder is a layer; the modules at the top
# are the leaves every layer may use, or adapters on one layer.
LAYERS = {
    "values": 0,  # the checks of plain values
    "errors": 1, "faults": 1, "provider_headers": 1, "metrics": 1, "testing": 1, "usage": 1,
    "core": 2,
    "answers": 2,  # what a provider's answer means (over the errors it raises)
    "langchain": 3,  # a chat model's rate limiter on the core's gates
    "transport": 3,  # an HTTP client's transport on the core's gates
    "client_limits": 3,  # the limits a gated client makes of its arguments
    "room": 4,
    "integration": 5,
    "ops": 6,
}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name below it ("core.gate", "errors", ...)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def _imports() -> dict[str, set[str]]:
    """Each module's imports of the package's modules, lazy ones inside functions included."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = [*base, *(node.module.split(".") if node.module else [])]
                targets = [".".join(stem)] if node.module else []
                targets += [".".join([*stem, a.name]) for a in node.names]
                found |= {t for t in targets if t in modules and t != name}
            elif isinstance(node, ast.Import | ast.ImportFrom):
                absolute = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                found |= {a.removeprefix("celery_throttle.") for a in absolute
                          if a.startswith("celery_throttle.")} & set(modules)
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer (the package's ``__init__`` re-exports, so it is exempt)."""
    return sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src
                  for dst in dsts if dst and _layer(dst) > _layer(src))


def test_every_module_belongs_to_a_layer() -> None:
    """A new top-level module or folder is given its place in LAYERS before it is used."""
    assert sorted({m.split(".")[0] for m in _modules()} - set(LAYERS)) == []


def test_imports_run_one_way_from_the_leaves_up() -> None:
    """No module imports one of a higher layer: core -> room -> integration -> ops."""
    assert _upward(_imports()) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    """Negative control: a made-up room module importing the integration is reported."""
    assert _upward({"room.x": {"integration.config"}, "ops.cli": {"core.gate"}}) == [
        "room.x -> integration.config"]


def test_the_package_has_no_import_circle() -> None:
    """No import circle among the package's modules, lazy imports included."""
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check itself: a made-up a -> b -> c -> a is reported."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_leaves_import_nothing_but_the_value_checks() -> None:
    """values, errors, faults, metrics and testing sit at the bottom: values imports nothing
    of the package, the others at most values."""
    graph = _imports()
    leaves = sorted(name for name, layer in LAYERS.items() if layer <= 1)
    assert {name: graph[name] - {"values"} for name in leaves} == {name: set() for name in leaves}
    assert graph["values"] == set()


def test_the_core_and_the_gates_import_without_celery() -> None:
    """In a process where celery and kombu cannot be imported, the whole core, the top-level
    gate names and the LangChain adapter import, and nothing pulls Celery in."""
    core = sorted(f"celery_throttle.{m}" for m in _modules() if _layer(m) <= 3)
    script = textwrap.dedent(f'''
        import importlib, sys

        class NoCelery:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("celery", "kombu"):
                    raise ImportError(f"{{name}} is blocked in this test")
                return None

        sys.meta_path.insert(0, NoCelery())
        from celery_throttle import AsyncGate, Gate, Limit, ThrottleTimeout, check_response
        for name in {core!r}:
            importlib.import_module(name)
        try:
            from celery_throttle import throttled
        except ImportError as exc:
            print("throttled:", exc)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu")))
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # The negative control: the block works (the Celery side does need Celery).
    assert done.stdout.splitlines() == ["throttled: celery is blocked in this test", "[]"]


# Every piece of process-wide state in the package, and why it is one: a new
# module-level variable fails the test below until it is named here.
PROCESS_STATE = {
    "core.credit._unspent": "the start the running task was admitted for (a context "
                            "variable: one value per thread and coroutine)",
    "faults._hooks": "fault hooks a test's worker registered",
    "room.envelope._brokers": "each app's connection for confirmed re-publishes on "
                              "RabbitMQ and its delay ladder, made once per broker URL "
                              "(kombu pools by it)",
    "core.heartbeat._heartbeat": "one thread per process renews the leases held there",
    "integration.memory._frozen": "this pool process froze what it inherited",
    "integration.memory._pending": "a deferral left garbage for the next run to collect",
    "metrics._lock": "the counts below are updated from the threads pool's threads",
    "metrics._stats": "this process's counts per limit (what snapshot() reads)",
    "metrics._prom": "the Prometheus metrics: one registry per process",
    "integration.history._writer": "the one writer taking this process's counts per second",
    "metrics._seconds": "this process's counts per second, until the history writer takes them",
    "metrics._wall": "the wall clock the counts per second are filed by (tests replace it)",
    "integration.revokes._listeners": "each app's listeners of the revoke commands its "
                                      "worker node receives (Celery's command registry is "
                                      "process-wide too)",
    "integration.runtime._cache": "each app's runtime (settings, client) in this process, "
                                  "weakly keyed",
    "integration.runtime._lock": "the threads pool may build a runtime concurrently",
    "integration.throttled._shared_specs": "@throttled on shared tasks, by task name: each "
                                           "app's copy gets them",
    "integration.visible._backends": "one result backend per app for the THROTTLED writes "
                                     "(Celery's is one per thread, per greenlet in green pools)",
    "integration.visible._lock": "the threads pool may ask for that backend concurrently",
}


def test_process_wide_state_is_all_named() -> None:
    """Module-level mutable state is the list above (lower-case, underscored module globals;
    constants are upper-case): nothing hidden, each with its reason."""
    found = set()
    for name, path in _modules().items():
        for stmt in ast.parse(path.read_text()).body:
            targets = ([t for t in stmt.targets if isinstance(t, ast.Name)]
                       if isinstance(stmt, ast.Assign) else
                       [stmt.target] if isinstance(stmt, ast.AnnAssign)
                       and isinstance(stmt.target, ast.Name) else [])
            found |= {f"{name}.{t.id}" for t in targets
                      if t.id.startswith("_") and not t.id.startswith("__") and not t.id.isupper()}
    assert found == set(PROCESS_STATE)


def test_no_module_imports_a_private_name_of_another() -> None:
    """`from .x import _name` across modules is a rule living in the wrong place: none."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def test_the_records_are_imported_from_one_module() -> None:
    """Limits, decisions and reservations live in core/limits.py; the package imports them
    from there (core.gate re-exports them for users who import them from it)."""
    records = {"AnyLimit", "BucketState", "Concurrency", "Decision", "LeaseState", "Limit",
               "Reservation", "DEFAULT_LEASE", "ADMITTED"}
    through_gate = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and node.module in ("gate",
                                                                                 "core.gate"):
                through_gate += [f"{path.name}: {a.name}" for a in node.names
                                 if a.name in records]
    assert through_gate == []


# Where key names are built: the core's modules build only the core's keys (core/keys.py:
# the limits, their lines, the epoch, the freed set and the doorbell).  The waiting room's
# own keys (room/keys.py: its messages, parked and claimed sets, the lines' ready index,
# the trip estimate, the wait notes) are built by room_key, or spelled ":room:".
_ROOM_KEY_NAMES = re.compile(r"\broom_key\(|:room:")


def _room_keys_named(source: str) -> list[str]:
    """The lines of a module's source that build a waiting-room key's name."""
    return [line.strip() for line in source.splitlines()
            if _ROOM_KEY_NAMES.search(line) and not line.strip().startswith("#")]


def test_the_cores_scripts_are_given_only_the_cores_keys() -> None:
    """Every KEYS list the core's modules build names only keys of the core's own."""
    named = {path.name: _room_keys_named(path.read_text())
             for path in sorted((PACKAGE / "core").glob("*.py"))}
    assert {name: lines for name, lines in named.items() if lines} == {}


def test_the_key_check_refuses_a_core_script_given_a_room_key() -> None:
    """A release that rang the room's ready index itself, as it once did, is caught."""
    call = 'keys += [room_key(self.prefix, part).encode() for part in ("ready", "wake")]'
    assert _room_keys_named(f"def _release_call(self):\n    {call}\n") == [call]
    spelled = 'keys.append(f"{{{self.prefix}}}:room:ready".encode())'
    assert _room_keys_named(spelled) == [spelled]
    assert _room_keys_named("keys.append(freed_key(self.prefix).encode())") == []
