"""Stream chunks as a client handed them over (plain dicts): each validated against OpenAI's schema,
then added up into what the stream said."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import openai_schema
from openai_schema import COMPLETION_CHUNK


@dataclass
class ChatStream:
    text: str = ""
    # choices[].logprobs.content of every chunk, in order.
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class CompletionStream:
    text: str = ""
    # choices[].logprobs of every chunk, each list joined.
    logprobs: dict[str, list[Any]] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )
    finish_reasons: list[str] = field(default_factory=list)


def join_chat(chunks: Iterable[dict[str, Any]]) -> ChatStream:
    joined = ChatStream()
    for chunk in chunks:
        openai_schema.validate(chunk, "CreateChatCompletionStreamResponse")
        joined.usage = chunk.get("usage") or joined.usage
        for choice in chunk["choices"]:
            joined.text += choice["delta"].get("content") or ""
            joined.logprobs += (choice.get("logprobs") or {}).get("content") or []
            if choice.get("finish_reason"):
                joined.finish_reasons.append(choice["finish_reason"])
    return joined


def join_completion(chunks: Iterable[dict[str, Any]]) -> CompletionStream:
    joined = CompletionStream()
    for chunk in chunks:
        openai_schema.validate(chunk, COMPLETION_CHUNK)
        for choice in chunk["choices"]:
            joined.text += choice["text"]
            for key, values in (choice.get("logprobs") or {}).items():
                joined.logprobs[key] += values
            if choice.get("finish_reason"):
                joined.finish_reasons.append(choice["finish_reason"])
    return joined
