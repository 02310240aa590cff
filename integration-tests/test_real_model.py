"""The real demo model through the whole stack, against transformers and peft on the very files
the launcher wrote (SmolLM2-135M-Instruct, dequantized, and the pirate adapter): greedy chat
answers equal token for token (DESIGN.md's rule: a divergence only after a top-two tie), the
adapter's equal peft's, streamed equals non-streamed, logprobs equal log_softmax of the
reference's logits within 1e-4, a JSON-schema answer validates, and a batch that mixes the base,
the adapter and sampled requests keeps every greedy row exact."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import reference
from adapter_models import PeakRunning, greedy_with
from demo_stack import ADAPTER, BASE, Demo
from served import RETURN_TOKEN_IDS, prompt_token_ids, stream_token_ids, token_ids

MAX_TOKENS = 48
LOGPROB_TOLERANCE = 1e-4

QUESTIONS = [
    "What is the capital of France?",
    "Who painted the Mona Lisa?",
    "Give me three tips for learning to code.",
    "What is the boiling point of water?",
    "Write a haiku about autumn.",
    "Explain what a neural network is in one sentence.",
]
# A conversation with a system prompt of its own and an earlier exchange.
CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a planet."},
    {"role": "assistant", "content": "Mars."},
    {"role": "user", "content": "How far is it from the sun?"},
]
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def _chats() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": question}] for question in QUESTIONS] + [CONVERSATION]


def _adapter_dir(demo: Demo, model: str) -> Path | None:
    return demo.adapter_dir if model == ADAPTER else None


def _reference(demo: Demo, model: str, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> reference.Greedy:
    return greedy_with(demo.model_dir, _adapter_dir(demo, model), prompt_ids, max_tokens)


def _check_greedy(demo: Demo, model: str, messages: list[dict[str, str]], response: Any, context: str) -> None:
    prompt = reference.chat_prompt_ids(str(demo.model_dir), messages)
    assert prompt_token_ids(response) == prompt, f"{context}: the prompt was tokenized differently"
    served = token_ids(response)
    reference.assert_greedy_parity(served, _reference(demo, model, prompt), context)
    text = reference.load_tokenizer(str(demo.model_dir)).decode(served, skip_special_tokens=True)
    assert response.choices[0].message.content == text, context


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_greedy_chat_equals_the_reference(demo, model):
    with demo.client() as client:
        for index, messages in enumerate(_chats()):
            response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body=RETURN_TOKEN_IDS)
            _check_greedy(demo, model, messages, response, f"{model} chat {index}")


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_streamed_equals_non_streamed(demo, model):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    with demo.client() as client:
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body=RETURN_TOKEN_IDS)
        text, ids, finish = "", [], None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, extra_body=RETURN_TOKEN_IDS):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += stream_token_ids(choice)
                finish = choice.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert ids == token_ids(whole)
    assert finish == whole.choices[0].finish_reason


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_logprobs_equal_log_softmax_of_the_reference(demo, model):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    with demo.client() as client:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, logprobs=True, top_logprobs=3,
                                                  extra_body=RETURN_TOKEN_IDS)
    served = token_ids(response)
    greedy = _reference(demo, model, prompt_token_ids(response))
    reference.assert_greedy_parity(served, greedy, f"{model} logprobs")
    content = response.choices[0].logprobs.content
    assert len(content) == len(served)
    compared = 0
    for position, (token, entry) in enumerate(zip(served, content, strict=True)):
        if position >= len(greedy.token_ids) or greedy.token_ids[position] != token:
            break  # after a tie the two continuations differ: nothing left to compare
        expected = torch.log_softmax(greedy.logits[position].double(), dim=-1)
        assert abs(entry.logprob - expected[token].item()) <= LOGPROB_TOLERANCE, (position, entry.logprob)
        top = torch.topk(expected, 3)
        for got, want in zip(entry.top_logprobs, top.values.tolist(), strict=True):
            assert abs(got.logprob - want) <= LOGPROB_TOLERANCE, (position, got, want)
        compared += 1
    assert compared >= 4, f"only {compared} positions compared"


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_json_schema_answer_validates(demo, model):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON with the city and "
                                            "its country."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY_SCHEMA}}
    with demo.client() as client:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=96, temperature=0,
                                                  response_format=response_format)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), CITY_SCHEMA)


def test_a_mixed_batch_keeps_every_greedy_row_exact(demo):
    """Base and adapter, greedy and sampled, sent at once: they share decode steps, and every
    greedy row still equals its reference."""
    rng = random.Random(7)
    requests = []
    for index, messages in enumerate(_chats()):
        for model in (BASE, ADAPTER):
            sampled = rng.random() < 0.4
            requests.append((model, messages, sampled, index))

    async def main() -> list[Any]:
        async with demo.async_client() as client:
            calls = [
                client.chat.completions.create(
                    model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body=RETURN_TOKEN_IDS,
                    **({"temperature": 1.0, "seed": index} if sampled else {"temperature": 0}),
                )
                for model, messages, sampled, index in requests
            ]
            return await asyncio.gather(*calls)

    peak = PeakRunning(demo.stack)
    with peak:
        responses = asyncio.run(main())
    assert peak.value >= 2, f"the requests never ran together (peak {peak.value} running)"
    assert any(sampled for _, _, sampled, _ in requests) and not all(sampled for _, _, sampled, _ in requests)
    for (model, messages, sampled, index), response in zip(requests, responses, strict=True):
        if not sampled:
            _check_greedy(demo, model, messages, response, f"mixed batch: {model} chat {index}")
