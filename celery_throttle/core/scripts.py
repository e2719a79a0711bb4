"""The one loader of the Lua scripts: each layer keeps its scripts in its own ``lua/`` folder.

A script is package data, read once per process (``importlib.resources``,
so it works from a wheel or a zip).  Callers register it with redis-py's
``register_script``, which sends EVALSHA and reloads the body on NOSCRIPT.
"""

from __future__ import annotations

import functools
import importlib.resources

__all__ = ["source"]


@functools.cache
def source(package: str, name: str) -> str:
    """The text of ``lua/<name>`` in ``package`` (the caller's ``__package__``)."""
    return importlib.resources.files(package).joinpath(f"lua/{name}").read_text("utf-8")
