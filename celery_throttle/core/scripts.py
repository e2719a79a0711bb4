"""The one loader of the Lua scripts: each layer keeps its scripts in its own ``lua/`` folder.

A script is package data, read once per process (``importlib.resources``,
so it works from a wheel or a zip).  Callers register it with redis-py's
``register_script``, which sends EVALSHA and reloads the body on NOSCRIPT.

Redis has no ``require``: a script names the files it needs at its top, one
line each, as BullMQ's scripts do::

    --- @include "core/bucket.lua"

(``<layer>/<file>``: the file in that layer's ``lua/`` folder).  The loader
puts each included text in front of the script, its own includes first, each
file once however many scripts of the tree name it; so each shared rule has
one copy in the source.  It refuses, naming the file, an include that does
not exist, one a file names twice, and one that leads back to itself.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Callable

__all__ = ["ScriptError", "resolve", "script"]

_ROOT = __package__.rpartition(".")[0]  # "celery_throttle"
_INCLUDE = re.compile(r'^--- @include "([a-z_]+/[a-z_]+\.lua)"\s*$', re.MULTILINE)


class ScriptError(ValueError):
    """A script's includes cannot be resolved (the message names the file)."""


def _read(path: str) -> str:
    """The text of ``<layer>/<file>``: ``celery_throttle/<layer>/lua/<file>``."""
    layer, _, name = path.partition("/")
    try:
        return importlib.resources.files(f"{_ROOT}.{layer}").joinpath(f"lua/{name}") \
            .read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ScriptError(f"no Lua script {path!r}") from exc


def resolve(path: str, read: Callable[[str], str] = _read) -> str:
    """The script ``path`` (``<layer>/<file>``) with its includes in front, as one text."""
    done: list[str] = []  # the files put in, in order (each once)
    texts: list[str] = []

    def visit(current: str, chain: tuple[str, ...]) -> None:
        if current in chain:
            loop = " -> ".join((*chain[chain.index(current):], current))
            raise ScriptError(f"circular include in {chain[-1]!r}: {loop}")
        if current in done:
            return
        try:
            text = read(current)
        except ScriptError:
            if chain:
                raise ScriptError(f"{chain[-1]!r} includes {current!r}, which does not "
                                  "exist") from None
            raise
        named = _INCLUDE.findall(text)
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:
            raise ScriptError(f"{current!r} includes {twice[0]!r} twice")
        for include in named:
            visit(include, (*chain, current))
        done.append(current)
        texts.append(text)

    visit(path, ())
    return "\n".join(texts)


@functools.cache
def script(package: str, name: str) -> str:
    """The script ``lua/<name>`` of ``package`` (the caller's ``__package__``), with its
    includes in front (read and resolved once per process)."""
    return resolve(f"{package.rpartition('.')[2]}/{name}")
