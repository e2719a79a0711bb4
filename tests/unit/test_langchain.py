"""The LangChain adapter (langchain.py): a chat model's rate_limiter= on the gate.

A chat model of langchain-core's own base class calls the mock provider (a
real HTTP server on 127.0.0.1); threads, coroutines and plain gate users
share one limit, and the provider sees the combined rate within the bound.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from celery_throttle import Gate, Limit, parse_rate
from celery_throttle.langchain import GateRateLimiter
from celery_throttle.testing import max_in_window
from examples import provider as mock


class ProviderChat(BaseChatModel):
    """A chat model whose every call is a POST to the mock provider."""

    url: str

    @property
    def _llm_type(self) -> str:
        return "mock-provider"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        body = mock.summarize(self.url, str(messages[-1].content))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=json.dumps(
            body["usage"])))])


@pytest.fixture
def provider() -> Iterator[mock.MockProvider]:
    server = mock.MockProvider(limit=10, window=1.0, latency=0.01).start()
    yield server
    server.stop()


def test_threads_coroutines_and_gate_users_share_one_quota(
        provider: mock.MockProvider, redis_url: str, prefix: str) -> None:
    """12 invokes from 4 threads, 12 ainvokes and 6 plain Gate.wait callers, one limit of
    8/s under a provider's 10 per 1 s: 0 429s, worst 1 s window <= 9, all 30 done."""
    limiter = GateRateLimiter("8/s", name="llm", url=redis_url, prefix=prefix, timeout=30)
    model = ProviderChat(url=provider.url, rate_limiter=limiter)
    gate = Gate.from_url(redis_url, prefix=prefix)
    shared = [Limit("llm", parse_rate("8/s"))]  # a worker's @throttled("8/s", name="llm")
    done: list[str] = []

    def invokes() -> None:
        for i in range(3):
            done.append(str(model.invoke(f"thread call {i}").content))

    def gate_user() -> None:
        for i in range(6):
            gate.wait(shared, timeout=30)
            mock.summarize(provider.url, f"task {i}")
            done.append("task")

    async def ainvokes() -> None:
        try:
            replies = await asyncio.gather(*(model.ainvoke(f"async call {i}")
                                             for i in range(12)))
        finally:
            await limiter.aclose()
        done.extend(str(r.content) for r in replies)

    threads = [threading.Thread(target=invokes) for _ in range(4)]
    threads.append(threading.Thread(target=gate_user))
    for t in threads:
        t.start()
    asyncio.run(ainvokes())
    for t in threads:
        t.join(60)
    limiter.close()
    gate.client.close()
    assert len(done) == 30
    assert provider.refused == []
    assert max_in_window(provider.accepted, 1.0) <= 9
    span = max(provider.accepted) - min(provider.accepted)
    assert (len(provider.accepted) - 1) / span >= 0.85 * 8


def test_non_blocking_acquire_says_whether_a_call_may_go(redis_url: str, prefix: str) -> None:
    """blocking=False answers at once, charging only when it says yes."""
    limiter = GateRateLimiter("1/h", name="once", url=redis_url, prefix=prefix)
    assert limiter.acquire(blocking=False) is True
    assert limiter.acquire(blocking=False) is False
    limiter.close()

    async def from_async_code() -> bool:
        try:
            return await limiter.aacquire(blocking=False)
        finally:
            await limiter.aclose()

    assert asyncio.run(from_async_code()) is False
    with pytest.raises(ValueError, match="give url"):
        GateRateLimiter("1/s", name="x")


def test_a_deep_copy_of_a_model_keeps_its_limiter(redis_url: str, prefix: str) -> None:
    """LangChain deep-copies models (model_copy(deep=True), copy.deepcopy): the copy spends
    the same quota through the same limiter; pickling still says why it cannot."""
    import copy
    import pickle

    limiter = GateRateLimiter("1/h", name="copied", url=redis_url, prefix=prefix)
    model = ProviderChat(url="http://127.0.0.1:9", rate_limiter=limiter)
    assert copy.deepcopy(model).rate_limiter is limiter
    assert model.model_copy(deep=True).rate_limiter is limiter
    with pytest.raises(TypeError, match="one per process"):
        pickle.dumps(limiter)
    limiter.close()
