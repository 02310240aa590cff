"""The official `openai` Python SDK's `AsyncOpenAI`: chat and completions, plain and streamed,
in flight at once, with logprobs and echo; each body and chunk validated against OpenAI's schema."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

import openai_schema
from client_streams import ChatStream, CompletionStream, join_chat, join_completion
from logprob_checks import check_chat_logprobs, check_completion_logprobs
from openai_schema import COMPLETION_ECHO

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count to three."}]
PROMPT = "One, two,"
ALL_TOKENS = {"ignore_eos": True}
MAX_TOKENS = 5
# Batched with different neighbours, the same logits may differ in the last bits.
BATCH_TOLERANCE = 1e-4


CHAT_LOGPROBS = {"logprobs": True, "top_logprobs": 4}
ECHO_LOGPROBS = {"logprobs": 2, "echo": True}


@dataclass
class Answers:
    """Four requests in flight at once: chat plain and streamed, completion plain and streamed."""

    chat: dict[str, Any]
    chat_stream: ChatStream
    completion: dict[str, Any]
    completion_stream: CompletionStream


async def _chat(client: openai.AsyncOpenAI, model: str, options: dict[str, Any]) -> dict[str, Any]:
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=ALL_TOKENS, **options
    )
    body = raw.http_response.json()
    openai_schema.validate(body, "CreateChatCompletionResponse")
    return body


async def _chat_stream(client: openai.AsyncOpenAI, model: str, options: dict[str, Any]) -> ChatStream:
    stream = await client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=ALL_TOKENS,
        **options,
    )  # fmt: skip
    return join_chat([chunk.to_dict() async for chunk in stream])


async def _completion(client: openai.AsyncOpenAI, model: str, options: dict[str, Any]) -> dict[str, Any]:
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=ALL_TOKENS, **options
    )
    body = raw.http_response.json()
    openai_schema.validate(body, COMPLETION_ECHO if options.get("echo") else "CreateCompletionResponse")
    return body


async def _completion_stream(client: openai.AsyncOpenAI, model: str, options: dict[str, Any]) -> CompletionStream:
    stream = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=ALL_TOKENS,
        **options,
    )  # fmt: skip
    return join_completion([chunk.to_dict() async for chunk in stream])


async def _all_at_once(served: Any, chat_options: dict[str, Any], completion_options: dict[str, Any]) -> Answers:
    async with served.async_client() as client:
        chat, chat_stream, completion, completion_stream = await asyncio.gather(
            _chat(client, served.model, chat_options),
            _chat_stream(client, served.model, chat_options),
            _completion(client, served.model, completion_options),
            _completion_stream(client, served.model, {}),
        )
    return Answers(chat, chat_stream, completion, completion_stream)


def test_concurrent_requests(llama):
    answers = asyncio.run(_all_at_once(llama, {}, {}))
    # Greedy: each stream is its plain twin.
    assert answers.chat_stream.text == answers.chat["choices"][0]["message"]["content"]
    assert answers.completion_stream.text == answers.completion["choices"][0]["text"]
    assert answers.chat_stream.finish_reasons == answers.completion_stream.finish_reasons == ["length"]


def test_concurrent_requests_with_logprobs(llama):
    answers = asyncio.run(_all_at_once(llama, CHAT_LOGPROBS, ECHO_LOGPROBS))

    chat_choice = answers.chat["choices"][0]
    assert chat_choice["logprobs"] is not None, "logprobs: true answered with logprobs: null"
    plain = chat_choice["logprobs"]["content"]
    check_chat_logprobs(plain, 4, chat_choice["message"]["content"], str(llama.model_dir))
    streamed = answers.chat_stream.logprobs
    assert [entry["token"] for entry in streamed] == [entry["token"] for entry in plain]
    for one, other in zip(streamed, plain, strict=True):
        assert abs(one["logprob"] - other["logprob"]) <= BATCH_TOLERANCE, (one, other)

    echo_choice, usage = answers.completion["choices"][0], answers.completion["usage"]
    assert echo_choice["text"] == PROMPT + answers.completion_stream.text
    check_completion_logprobs(
        echo_choice["logprobs"], 2, echo_choice["text"], echoed_prompt=PROMPT, prompt_tokens=usage["prompt_tokens"]
    )
