"""The README stays true: every setting documented, the two commands and CI wired as it says."""

from __future__ import annotations

import re
from pathlib import Path

from celery_throttle.config import SETTINGS

ROOT = Path(__file__).resolve().parent.parent


def test_every_setting_is_in_the_readme_table() -> None:
    """The README's settings table names exactly the settings the code reads."""
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"^\| `(throttle_\w+)` \|", readme, flags=re.MULTILINE))
    assert documented == set(SETTINGS)


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    """`make demo` and `make test` are Makefile targets; .ci/run runs `make test`."""
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "make demo" in readme
    assert "make test" in readme
    assert re.search(r"^demo:", makefile, flags=re.MULTILINE)
    assert re.search(r"^test:", makefile, flags=re.MULTILINE)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_guarantees_table_names_only_real_tests() -> None:
    """Every test the README's guarantees table cites exists (the table matches the tests)."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Guarantees and failure modes", 1)[1].split("\n## ", 1)[0]
    cited = set(re.findall(r"`(test_\w+)`", table))
    assert len(cited) >= 15
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), flags=re.MULTILINE))
    assert cited <= defined, cited - defined


def test_version_is_the_distributions_and_in_the_changelog() -> None:
    """One version: the package's ``__version__``, read by the build, named in CHANGELOG.md."""
    import importlib.metadata

    import celery_throttle

    assert importlib.metadata.version("celery-gcra-throttle") == celery_throttle.__version__
    changelog = (Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()
    assert f"## {celery_throttle.__version__}" in changelog
