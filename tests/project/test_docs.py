"""The documentation stays true: every setting documented, the commands and CI wired as it
says, the site builds with no dead link."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from celery_throttle.integration.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def _settings_row(name: str, default: object, meaning: str) -> str:
    """The settings page's row of one setting, as ``SETTINGS`` says it: a default the code
    computes is the meaning's ``; default:`` tail, any other the literal."""
    computed = meaning.rpartition("; default: ")
    if default is None and computed[1]:
        meaning, cell = computed[0], computed[2]
    else:
        literal = json.dumps(default) if isinstance(default, str) else repr(default)
        cell = f"`{literal}`"
    return f"| `{name}` | {cell} | {meaning.replace('|', chr(92) + '|')} |"


def test_the_settings_table_is_settings_own_words() -> None:
    """The settings page's table is ``SETTINGS`` row for row: every name, default and
    meaning, in order (a meaning is written once, in the code)."""
    page = (ROOT / "docs" / "guide" / "settings.md").read_text()
    table = re.findall(r"^\| `throttle_\w+` \|.*$", page, flags=re.MULTILINE)
    assert table == [_settings_row(name, *SETTINGS[name]) for name in SETTINGS]


#: What a measured figure looks like in prose, in any case: "(measured", "measured" with a
#: number in its sentence (a file name's dot does not end it), a ratio ("0.88x") or a
#: percentage (not a format's "{:.0%}").
_FIGURE = re.compile(r"\(measured|measured(?:[^.;]|\.(?=\w)){0,200}?\d"
                     r"|(?<![.\d])\d+(\.\d+)?x\b|(?<![.\d])\d+(\.\d+)? ?%", re.IGNORECASE)


@pytest.mark.parametrize("text", [
    "(measured: 3 ms)", "Measured on a small message (``tests/x.py``): 906 bytes",
    "costs 0.88x of PING", "about 12 % more", "MEASURED AT 5 RUNS"])
def test_the_figure_check_finds_a_figure(text: str) -> None:
    """Fed a figure in any of its shapes, the check below finds it."""
    assert _FIGURE.search(text)


def test_the_figure_check_lets_a_sentence_without_a_figure_pass() -> None:
    """A sentence that names a measurement without quoting one passes, so does a format."""
    assert not _FIGURE.search("the trip is measured at each arrival. Then 3 tries")
    assert not _FIGURE.search("f'{share:.0%}'")


def test_the_package_quotes_no_measured_figure() -> None:
    """Figures live in BENCHMARKS.md with the command that measured them; the package's
    docstrings and comments say why, and go stale with no figure in them."""
    quoted = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, hit.start()) + 1}: {hit[0]}"
              for path in sorted((ROOT / "celery_throttle").rglob("*"))
              if path.suffix in (".py", ".lua")
              for text in [path.read_text()]
              for hit in _FIGURE.finditer(text)]
    assert quoted == []


#: Where the package may still say "slot": 0.1.0's names, kept as deprecated aliases, and the
#: message header's field, which 0.1.0 wrote (docs/glossary.md: a booked start, a seat).
_SLOT_ALLOWED = {"celery_throttle/core/limits.py": 12, "celery_throttle/room/header.py": 2,
                 "celery_throttle/room/envelope.py": 1}


def says_slot(line: str) -> bool:
    """Does ``line`` say "slot", as a word or inside an identifier (``await_slot``,
    ``started_slot``)?  (``slots=True``, a dataclass option, is not the word.)"""
    return re.search(r"(?<![a-z0-9])slots?(?![a-z0-9])", line.replace("slots=True", ""),
                     flags=re.IGNORECASE) is not None


@pytest.mark.parametrize("line", ["a booked slot", "def _wait_for_slot():", "await_slot(",
                                  '"started_slot": 1', "Slots: 3", "SLOT_GRACE = 1"])
def test_the_slot_check_sees_the_word_and_identifiers(line: str) -> None:
    """Fed the word, alone or inside an identifier, the check below finds it."""
    assert says_slot(line)


def test_the_slot_check_lets_other_words_and_the_dataclass_option_pass() -> None:
    """``slots=True`` and words that only contain the letters (``slotted``) pass."""
    assert not says_slot("@dataclass(frozen=True, slots=True)")
    assert not says_slot("a slotted rack")


#: The tests named for a slot: a Redis Cluster hash slot, the one meaning the word keeps
#: (and the tests of the check, which name the word it keeps out).
_SLOT_TESTS = {"test_the_package_says_booked_start_and_seat_never_slot",
               "test_the_slot_check_sees_the_word_and_identifiers",
               "test_the_slot_check_lets_other_words_and_the_dataclass_option_pass",
               "test_keys_share_one_slot_and_never_collide",
               "test_key_values_never_collide_and_never_move_the_slot",
               "test_cluster_gate_room_and_leases_keep_one_slot",
               "test_moved_after_resharding_the_prefix_slot_is_survived"}


def test_the_package_says_booked_start_and_seat_never_slot() -> None:
    """One word per meaning (docs/glossary.md): a start booked ahead is a booked start and a
    concurrency limit's run a seat; "slot" is left only where 0.1.0's names need it, and
    names a test only for a Redis Cluster hash slot."""
    said: dict[str, int] = {}
    for path in sorted((ROOT / "celery_throttle").rglob("*")):
        if path.suffix in (".py", ".lua", ".js", ".html"):
            lines = [line for line in path.read_text().splitlines() if says_slot(line)]
            if lines:
                said[str(path.relative_to(ROOT))] = len(lines)
    assert said == _SLOT_ALLOWED
    named = {name for path in (ROOT / "tests").rglob("test_*.py")
             for name in re.findall(r"^def (test_\w*slot\w*)\(", path.read_text(),
                                    flags=re.MULTILINE)}
    assert named == _SLOT_TESTS


def test_every_metric_served_is_documented() -> None:
    """The observability page names every metric the package serves."""
    page = (ROOT / "docs" / "guide" / "observability.md").read_text()
    code = "".join((ROOT / "celery_throttle" / path).read_text()
                   for path in ("metrics.py", "integration/exporter.py"))
    served = set(re.findall(r"\"(celery_throttle_\w+)\"", code))
    assert len(served) >= 10
    assert {name for name in served if name not in page} == set()


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
    """Every test the guarantees table cites exists (the table matches the tests)."""
    table = (ROOT / "docs" / "guarantees.md").read_text()
    cited = set(re.findall(r"`(test_\w+)`", table))
    assert len(cited) >= 15
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), flags=re.MULTILINE))
    assert cited <= defined, cited - defined


def test_version_is_the_distributions_and_in_the_changelog() -> None:
    """One version: the package's ``__version__``, read by the build, named in CHANGELOG.md."""
    import importlib.metadata

    import celery_throttle

    assert importlib.metadata.version("celery-gcra-throttle") == celery_throttle.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {celery_throttle.__version__}" in changelog


_DOC_FILES = ["mkdocs.yml", "README.md", "BENCHMARKS.md", "CHANGELOG.md",
              "benchmarks/charts/provider_view.png"]


def _build_site(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`make docs`'s build (strict: a warning, dead links and anchors included, fails it).

    Never with ``-q``: mkdocs then drops the warnings before strict mode counts them
    (a dead link built with exit 0; the negative control below caught it).
    """
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-d", str(out)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _copy_docs(into: Path) -> None:
    shutil.copytree(ROOT / "docs", into / "docs")
    for name in _DOC_FILES:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, into / name)


def test_docs_site_builds_with_no_dead_link(tmp_path: Path) -> None:
    """The site builds strictly: every page in the nav, every internal link and anchor alive,
    the API reference generated from the package's docstrings."""
    built = _build_site(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("acquire_many", "throttled", "install", "settle", "check_response"):
        assert name in reference, name
    home = (tmp_path / "site" / "index.html").read_text()
    assert "A short tour" in home  # the README is the home page


@pytest.mark.parametrize("dead", ["[gone](guide/no-such-page.md)",
                                  "[gone](semantics.md#no-such-anchor)"])
def test_docs_build_fails_on_a_dead_link(tmp_path: Path, dead: str) -> None:
    """Negative control: the same build on a copy with one dead link or anchor fails."""
    _copy_docs(tmp_path)
    page = tmp_path / "docs" / "getting-started.md"
    page.write_text(page.read_text() + f"\n{dead}\n")
    built = _build_site(tmp_path, tmp_path / "site")
    assert built.returncode != 0
    assert "no-such" in built.stdout + built.stderr


def test_readme_links_name_files_that_exist() -> None:
    """Every relative link of the README (GitHub's view of it) names a file of the repository."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
