"""Tokens: what a request to an LLM API will cost at most, and what it did cost.

A provider's token quota is charged when the request arrives, from what it
may use: the prompt's tokens (estimated from its characters, about four to a
token) plus the most it may answer (``max_tokens``; OpenAI's
``max_completion_tokens`` and ``max_output_tokens`` too).  The answer's
``usage`` then says what it used.  Read from the JSON bodies of OpenAI's
chat completions and responses and Anthropic's messages; a body with
neither shape costs its characters only.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["CHARS_PER_TOKEN", "PARTS", "estimate", "used"]

#: Characters per token, as the providers' own pre-request estimates count them.
CHARS_PER_TOKEN = 4
_MOST = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _text(value: Any) -> int:
    """Characters of text in a prompt's parts (strings, content blocks, nested lists)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text(v) for v in value)
    if isinstance(value, dict):
        return sum(_text(value[k]) for k in ("text", "content", "input") if k in value)
    return 0


#: What a token limit may count: all tokens, or a provider's separate input
#: and output quotas (Anthropic's); the same names as its headers' reports.
PARTS = ("tokens", "input-tokens", "output-tokens")


def _doc(body: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def estimate(body: bytes, part: str = "tokens") -> int:
    """The most a request with JSON ``body`` may cost in ``part`` (at least 1).

    Input: prompt characters / 4; output: the answer's cap (``max_tokens``...);
    tokens: both.  A body that is not a JSON object costs its length / 4.
    """
    doc = _doc(body)
    if doc is None:
        return max(1, math.ceil(len(body) / CHARS_PER_TOKEN))
    chars = sum(_text(doc.get(k)) for k in ("messages", "system", "prompt", "input",
                                              "instructions"))
    prompt = math.ceil(chars / CHARS_PER_TOKEN)
    most = max(0, next((doc[k] for k in _MOST if isinstance(doc.get(k), int)), 0))
    return max(1, {"input-tokens": prompt, "output-tokens": most}.get(part, prompt + most))


def used(body: bytes, part: str = "tokens") -> int | None:
    """The tokens an answer's ``usage`` reports in ``part``, or None if it has none.

    OpenAI: ``prompt_tokens``, ``completion_tokens``, ``total_tokens``
    (``input_tokens``/``output_tokens`` in its responses API); Anthropic:
    ``input_tokens`` (plus the cache's), ``output_tokens``.
    """
    doc = _doc(body)
    found = doc.get("usage") if doc is not None else None
    if not isinstance(found, dict):
        return None

    def count(*names: str) -> int | None:
        parts = [int(found[n]) for n in names if isinstance(found.get(n), int)]
        return max(0, sum(parts)) if parts else None

    inputs = count("prompt_tokens") if "prompt_tokens" in found else count(
        "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    outputs = count("completion_tokens", "output_tokens")
    if part == "input-tokens":
        return inputs
    if part == "output-tokens":
        return outputs
    total = count("total_tokens")
    if total is not None:
        return total
    return None if inputs is None and outputs is None else (inputs or 0) + (outputs or 0)
