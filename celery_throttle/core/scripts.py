"""The one loader of the Lua scripts: each layer keeps its scripts in its own ``lua/`` folder.

A script is package data, read once per process (``importlib.resources``,
so it works from a wheel or a zip).  Callers register it with redis-py's
``register_script``, which sends EVALSHA and reloads the body on NOSCRIPT.
Redis has no ``require``: a script that shares functions with another
(``core/lua/bucket.lua``, the rate bucket) is sent with them in front
(:func:`joined`), so each rule still has one copy in the source.
"""

from __future__ import annotations

import functools
import importlib.resources

__all__ = ["BUCKET", "EPOCH", "LEASE", "joined", "source"]


@functools.cache
def source(package: str, name: str) -> str:
    """The text of ``lua/<name>`` in ``package`` (the caller's ``__package__``)."""
    return importlib.resources.files(package).joinpath(f"lua/{name}").read_text("utf-8")


@functools.cache
def joined(*parts: tuple[str, str]) -> str:
    """The texts of ``(package, name)`` parts, in order, as one script."""
    return "\n".join(source(package, name) for package, name in parts)


#: The rate bucket's functions (``lua/bucket.lua``), put in front of every script using them.
BUCKET = (__package__, "bucket.lua")
#: The prefix's epoch, read or set (``lua/epoch.lua``), likewise.
EPOCH = (__package__, "epoch.lua")
#: A concurrency limit's seats (``lua/lease.lua``), after ``BUCKET``, likewise.
LEASE = (__package__, "lease.lua")
