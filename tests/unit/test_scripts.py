"""The Lua loader (core/scripts.py): includes named in the scripts, resolved once, refused
when missing, named twice or circular."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_throttle.core.scripts import ScriptError, resolve, script

PACKAGE = Path(__file__).resolve().parents[2] / "celery_throttle"


def _files(**texts: str) -> dict[str, str]:
    return {name.replace("__", "/") + ".lua": text for name, text in texts.items()}


def _reader(files: dict[str, str]) -> Callable[[str], str]:
    def read(path: str) -> str:
        if path not in files:
            raise ScriptError(f"no Lua script {path!r}")
        return files[path]
    return read


def test_includes_come_first_their_own_first_each_once() -> None:
    """A diamond (the script and one of its includes both need the bucket) puts the bucket
    in once, before everything that needs it, and the script last."""
    files = _files(
        core__bucket="-- bucket\n",
        core__lease='--- @include "core/bucket.lua"\n-- lease\n',
        room__serve='--- @include "core/bucket.lua"\n--- @include "core/lease.lua"\n-- serve\n')
    text = resolve("room/serve.lua", _reader(files))
    lines = [line for line in text.splitlines() if line and not line.startswith("---")]
    assert lines == ["-- bucket", "-- lease", "-- serve"]


def test_a_missing_include_is_refused_naming_both_files() -> None:
    files = _files(room__serve='--- @include "core/bukket.lua"\n')
    with pytest.raises(ScriptError, match=r"'room/serve.lua' includes 'core/bukket.lua', "
                                          r"which does not exist"):
        resolve("room/serve.lua", _reader(files))


def test_an_include_named_twice_is_refused() -> None:
    files = _files(core__bucket="", room__serve='--- @include "core/bucket.lua"\n'
                                               '--- @include "core/bucket.lua"\n')
    with pytest.raises(ScriptError, match=r"'room/serve.lua' includes 'core/bucket.lua' twice"):
        resolve("room/serve.lua", _reader(files))


def test_a_circular_include_is_refused_with_its_loop() -> None:
    files = _files(core__a='--- @include "core/b.lua"\n', core__b='--- @include "core/c.lua"\n',
                   core__c='--- @include "core/a.lua"\n', room__top='--- @include "core/a.lua"\n')
    with pytest.raises(ScriptError, match=r"circular include in 'core/c.lua': core/a.lua -> "
                                          r"core/b.lua -> core/c.lua -> core/a.lua"):
        resolve("room/top.lua", _reader(files))
    selfish = _files(core__a='--- @include "core/a.lua"\n')
    with pytest.raises(ScriptError, match=r"circular include in 'core/a\.lua'"):
        resolve("core/a.lua", _reader(selfish))


def test_a_script_that_does_not_exist_is_named() -> None:
    with pytest.raises(ScriptError, match=r"no Lua script 'room/nothing\.lua'"):
        script("celery_throttle.room", "nothing.lua")


def test_every_script_of_the_package_resolves_and_includes_what_it_uses() -> None:
    """Each script file loads; a script calling a shared function has its file in front."""
    shared = {"read_rate(": "core/bucket.lua", "epoch_of(": "core/epoch.lua",
              "take(": "core/lease.lua", "fair_tag(": "room/turns.lua",
              "split_record(": "room/record.lua", "limits_of(": "core/limits.lua",
              "clock_of(": "core/clock.lua", "server_us(": "core/clock.lua",
              "ring(": "core/bell.lua", "hand_out(": "room/lines.lua",
              "learns(": "core/learn.lua", "learning_of(": "core/learn.lua"}
    found = sorted(PACKAGE.glob("*/lua/*.lua"))
    assert len(found) >= 14
    for path in found:
        layer = path.parent.parent.name
        text = script(f"celery_throttle.{layer}", path.name)
        own = path.read_text("utf-8")
        assert text.endswith(own)
        for call, home in shared.items():
            if call in own and f"{layer}/{path.name}" != home:
                assert (PACKAGE / home.replace("/", "/lua/")).read_text("utf-8") in text, (
                    path, home)


def test_every_script_is_small_and_does_one_thing() -> None:
    """One script per command: each at most 350 lines, none choosing what to do by an
    argument (an "op" compared with a name); the gate loads every command of the core."""
    from celery_throttle.core.gate import COMMANDS

    found = sorted(PACKAGE.glob("*/lua/*.lua"))
    for path in found:
        own = path.read_text("utf-8")
        assert len(own.splitlines()) <= 350, path
        code = re.sub(r"--\[\[.*?\]\]|--[^\n]*", "", own, flags=re.S)
        # (An operation's name, compared with an argument; a flag such as enqueue.lua's
        # "1" is a condition of the one thing it does.)
        assert not re.search(r"\bop\b|ARGV\[[^]]+\]\s*==\s*'[a-z]+'", code), path
    libraries = {"bucket", "bell", "clock", "epoch", "learn", "lease", "limits"}
    core = {p.stem for p in found if p.parent.parent.name == "core"}
    assert core - libraries == set(COMMANDS)


def test_the_architecture_page_lists_every_script_with_its_includes() -> None:
    """docs/architecture.md names every script of the package, a command with the
    libraries it includes (as its own lines say) and a library in the libraries' table."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text("utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(
        r"^\| `([a-z]+/[a-z]+)\.lua` \|(.*)$", page, re.MULTILINE)}
    for path in sorted(PACKAGE.glob("*/lua/*.lua")):
        name = f"{path.parent.parent.name}/{path.stem}"
        assert name in rows, name
        own = path.read_text("utf-8")
        included = re.findall(r'^--- @include "[a-z]+/([a-z]+)\.lua"', own, re.MULTILINE)
        cells = [c.strip() for c in rows[name].split("|")]
        if len(cells) > 3:  # a command: writes | includes | keys
            assert sorted(c.strip() for c in cells[1].split(",") if c.strip()) == \
                sorted(included), name
