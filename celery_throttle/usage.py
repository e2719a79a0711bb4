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

__all__ = ["CHARS_PER_TOKEN", "estimate", "used"]

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


def estimate(body: bytes) -> int:
    """The most a request with JSON ``body`` may cost: prompt characters / 4 + the answer's cap.

    At least 1; a body that is not JSON costs its length / 4.
    """
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return max(1, math.ceil(len(body) / CHARS_PER_TOKEN))
    if not isinstance(doc, dict):
        return max(1, math.ceil(len(body) / CHARS_PER_TOKEN))
    chars = sum(_text(doc.get(k)) for k in ("messages", "system", "prompt", "input",
                                              "instructions"))
    most = next((doc[k] for k in _MOST if isinstance(doc.get(k), int)), 0)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + max(0, most))


def used(body: bytes) -> int | None:
    """The tokens an answer's ``usage`` reports (OpenAI's ``total_tokens``, else Anthropic's
    input, output and cache tokens), or None if it has none."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("total_tokens"), int):
        return max(0, int(usage["total_tokens"]))
    parts = [usage.get(k) for k in ("input_tokens", "output_tokens",
                                    "cache_creation_input_tokens", "cache_read_input_tokens")]
    counted = [int(p) for p in parts if isinstance(p, int)]
    return max(0, sum(counted)) if counted else None
