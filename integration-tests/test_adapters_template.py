"""An adapter directory with its own chat template (alone, or with its own tokenizer files) has
its chats rendered with that template: the prompt the server tokenized is exactly what
transformers' `apply_chat_template` makes with it (so `usage.prompt_tokens` counts it, and differs
from the base's), while the base model on the same server keeps its own template."""

from __future__ import annotations

import asyncio

import openai
import pytest

import reference
from adapter_models import (
    CHAT,
    MAX_TOKENS,
    PIRATE_TEMPLATE,
    SERVED_NAME,
    adapter_set,
    chat_ids,
    peft_greedy,
    start_stack,
)
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids

OWN_TEMPLATE = "template/own-template"  # chat_template.jinja only
OWN_TOKENIZER = "template/own-tokenizer"  # tokenizer files with the template in them

CHATS = [
    CHAT,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京?"}],
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "adapters-template")
    yield stack
    stack.stop()


def _expected_prompt(adapters, model: str | None, messages: list[dict]) -> list[int]:
    """The reference rendering: transformers with the template the model's directory holds."""
    if model == OWN_TEMPLATE:
        return chat_ids(adapters, messages, chat_template=PIRATE_TEMPLATE)
    if model == OWN_TOKENIZER:
        return chat_ids(adapters, messages, tokenizer_dir=adapters.adapter_dir(OWN_TOKENIZER))
    return chat_ids(adapters, messages)


def _chat(client, model: str | None, messages: list[dict]):
    return client.chat.completions.create(model=model or SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body=RETURN_TOKEN_IDS)


def _check(adapters, model: str | None, messages, response) -> None:
    context = f"{model or 'base'} {messages}"
    want = _expected_prompt(adapters, model, messages)
    assert prompt_token_ids(response) == want, f"{context}: rendered with another template"
    assert response.usage.prompt_tokens == len(want), context
    reference.assert_greedy_parity(token_ids(response), peft_greedy(adapters, model, want), context)


def test_reference_templates_differ_from_the_base(adapters):
    """Guards the test's power: each adapter's template gives another prompt length."""
    base = len(chat_ids(adapters, CHAT))
    for model in (OWN_TEMPLATE, OWN_TOKENIZER):
        assert len(_expected_prompt(adapters, model, CHAT)) != base, model
    own = [len(_expected_prompt(adapters, model, CHAT)) for model in (OWN_TEMPLATE, OWN_TOKENIZER)]
    assert own[0] != own[1], own


@pytest.mark.parametrize("model", [OWN_TEMPLATE, OWN_TOKENIZER])
def test_adapter_chat_uses_its_own_template(adapters, stack, model):
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for messages in CHATS:
            _check(adapters, model, messages, _chat(client, model, messages))
            # The base model, asked right after, still renders with the base's template.
            _check(adapters, None, messages, _chat(client, None, messages))


def test_templates_stay_per_request_in_a_concurrent_mix(adapters, stack):
    requests = [(model, messages) for _ in range(2) for model in (None, OWN_TEMPLATE, OWN_TOKENIZER)
                for messages in CHATS]

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(_chat(client, m, msgs) for m, msgs in requests)), 180)

    for (model, messages), response in zip(requests, asyncio.run(main()), strict=True):
        _check(adapters, model, messages, response)
