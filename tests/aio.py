"""An AsyncGate seen through Gate's blocking interface: the same tests run on both gates.

The coroutines run on an event loop in a thread of their own (one per test);
each call blocks until its coroutine is done, so a test written for
:class:`Gate` drives :class:`AsyncGate` unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from celery_throttle import AsyncGate

_CALL_TIMEOUT = 30.0  # seconds: a stuck coroutine fails the test instead of hanging it


class BlockingAsyncGate:
    """Calls ``AsyncGate`` coroutines from synchronous test code."""

    def __init__(self, url: str, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.inner = AsyncGate.from_url(url, **options)

    def run(self, coroutine: Any) -> Any:
        """Run one coroutine on the gate's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(_CALL_TIMEOUT)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if inspect.iscoroutinefunction(attr):
            method: Callable[..., Any] = attr

            def blocking(*args: Any, **kwargs: Any) -> Any:
                return self.run(method(*args, **kwargs))

            return blocking
        return attr

    def close(self) -> None:
        """Close the client on its loop, then stop the loop and its thread."""
        self.run(self.inner.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
