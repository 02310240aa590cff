"""Greedy output through the whole HTTP stack equals peft's, token for token, for every adapter
kind of issue 3 (ranks 4, 8, 16, 64; q/v only; every linear layer; MLP only; rsLoRA): inside one
concurrent burst that mixes all of them with the base model (the adapters are loaded on demand
by that burst), and each alone."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

import reference
from adapter_models import (
    ADAPTER_KINDS,
    CHAT,
    COMPLETION_PROMPTS,
    MAX_TOKENS,
    PeakRunning,
    SERVED_NAME,
    adapter_set,
    chat_ids,
    completion_ids,
    peft_greedy,
    start_stack,
)
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids

BURST_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "adapters-parity")
    yield stack
    stack.stop()


def _client(stack, cls):
    return cls(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _requests(adapters) -> list[tuple[str | None, str, object]]:
    """(adapter id or None for the base, kind of request, prompt or messages) for every model."""
    models = [None] + [adapters.kind_id(kind) for kind in ADAPTER_KINDS]
    out: list[tuple[str | None, str, object]] = []
    for model in models:
        out += [(model, "completion", prompt) for prompt in COMPLETION_PROMPTS]
        out.append((model, "chat", CHAT))
    return out


def _check(adapters, model: str | None, kind: str, prompt, response, context: str) -> None:
    if kind == "completion":
        prompt_ids = completion_ids(adapters, prompt)
        text = response.choices[0].text
    else:
        prompt_ids = chat_ids(adapters, prompt)  # no template of its own: the base's
        text = response.choices[0].message.content
    assert prompt_token_ids(response) == prompt_ids, f"{context}: prompt tokenized differently"
    ids = token_ids(response)
    reference.assert_greedy_parity(ids, peft_greedy(adapters, model, prompt_ids), context)
    want_text = reference.load_tokenizer(str(adapters.base_dir)).decode(ids, skip_special_tokens=True)
    assert text == want_text, f"{context}: text {text!r} != decode(token_ids) {want_text!r}"
    assert response.model == (model or SERVED_NAME), context


def _send(client, model: str | None, kind: str, prompt):
    """The request, through the sync client (a response) or the async one (an awaitable)."""
    common = dict(model=model or SERVED_NAME, max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS)
    if kind == "completion":
        return client.completions.create(prompt=prompt, **common)
    return client.chat.completions.create(messages=prompt, **common)


def test_adapters_change_the_reference_output(adapters):
    """Guards the tests' power: every adapter kind changes peft's greedy tokens for every prompt,
    so serving the base (or the wrong adapter) in its place cannot pass."""
    for kind in ADAPTER_KINDS:
        for prompt in COMPLETION_PROMPTS:
            ids = completion_ids(adapters, prompt)
            adapted = peft_greedy(adapters, adapters.kind_id(kind), ids).token_ids
            assert adapted != peft_greedy(adapters, None, ids).token_ids, (kind, prompt)
    outputs = {tuple(peft_greedy(adapters, adapters.kind_id(k), completion_ids(adapters, "Hello")).token_ids)
               for k in ADAPTER_KINDS}
    assert len(outputs) == len(ADAPTER_KINDS), "two adapter kinds give the same tokens"


def test_burst_mixing_every_kind_and_the_base_equals_peft(adapters, stack):
    """All kinds and the base, several requests each, sent at once in a shuffled order: the
    adapters load on demand while the base's requests run, and every output equals peft's."""
    requests = _requests(adapters)
    random.Random(3).shuffle(requests)

    async def main():
        async with _client(stack, openai.AsyncOpenAI) as client:
            return await asyncio.wait_for(asyncio.gather(*(_send(client, *r) for r in requests)), BURST_TIMEOUT_S)

    peak = PeakRunning(stack)
    with peak:
        responses = asyncio.run(main())
    for (model, kind, prompt), response in zip(requests, responses, strict=True):
        _check(adapters, model, kind, prompt, response, f"burst {model or 'base'} {kind} {prompt!r}")
    # Proof that they shared batches rather than running one after another.
    print(f"burst: peak {peak.value} of {peak.samples} samples")
    assert peak.value >= 8, f"at most {peak.value} requests ran at once ({peak.samples} samples)"


@pytest.mark.parametrize("kind", list(ADAPTER_KINDS))
def test_each_kind_alone_equals_peft(adapters, stack, kind):
    model = adapters.kind_id(kind)
    with _client(stack, openai.OpenAI) as client:
        # One at a time: no other request shares the batch.
        for _, k, prompt in [r for r in _requests(adapters) if r[0] == model]:
            response = _send(client, model, k, prompt)
            _check(adapters, model, k, prompt, response, f"alone {model} {k} {prompt!r}")


def test_base_alone_equals_transformers(adapters, stack):
    """The base model on a server with adapters loaded is still the plain base model, under each
    of its names: the served name, "" and the --model-id."""
    with _client(stack, openai.OpenAI) as client:
        for _, k, prompt in [r for r in _requests(adapters) if r[0] is None]:
            _check(adapters, None, k, prompt, _send(client, None, k, prompt), f"base alone {k} {prompt!r}")
        ids = completion_ids(adapters, "Hello")
        for name in ("", str(adapters.base_dir)):
            response = client.completions.create(model=name, prompt="Hello", max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body=RETURN_TOKEN_IDS)
            want = peft_greedy(adapters, None, ids)
            reference.assert_greedy_parity(token_ids(response), want, f"base as {name!r}")
