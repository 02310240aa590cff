"""Greedy output through the whole HTTP stack equals transformers' greedy output token for token
(DESIGN.md's correctness rule), for tiny random Llama, Mistral and Qwen2 models."""

from __future__ import annotations

import pytest

import reference
from conftest import ARCHS
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids

MAX_TOKENS = 16

COMPLETION_PROMPTS = [
    "Hello",
    "The quick brown fox",
    "東京と大阪",
    "Once upon a time there was",
    "🙂 🚀",
    "def add(a, b):",
    "Grüße aus Köln",
    "A language model predicts the next token; a server batches many requests together.",
]

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a city."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello. 🙂"},
        {"role": "user", "content": "東京?"},
    ],
]


def _check_choice(served, model_dir: str, response, prompt_ids: list[int], context: str,
                  index: int = 0) -> str:
    """Checks ids, text and finish_reason of one choice; returns its finish_reason."""
    assert prompt_token_ids(response, index) == prompt_ids, f"{context}: prompt tokenized differently"
    ids = token_ids(response, index)
    reference.assert_greedy_parity(ids, reference.greedy(model_dir, prompt_ids, MAX_TOKENS), context)

    eos = reference.load_model(model_dir).generation_config.eos_token_id
    choice = response.choices[index]
    assert choice.index == index, context
    ended_with_eos = bool(ids) and ids[-1] == eos
    if ended_with_eos:
        assert choice.finish_reason == "stop", f"{context}: EOS generated but {choice.finish_reason}"
    else:
        assert choice.finish_reason == "length", f"{context}: {choice.finish_reason}"
        assert len(ids) == MAX_TOKENS, f"{context}: 'length' after {len(ids)} tokens"

    text = choice.text if hasattr(choice, "text") else choice.message.content
    want = reference.load_tokenizer(model_dir).decode(ids, skip_special_tokens=True)
    assert text == want, f"{context}: text {text!r} != decode(token_ids) {want!r}"
    assert response.model == served.model, f"{context}: model {response.model!r}"
    return choice.finish_reason


def _check_usage(response, prompts: list[list[int]], context: str) -> None:
    generated = sum(len(token_ids(response, i)) for i in range(len(prompts)))
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (sum(map(len, prompts)), generated), context
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, context


@pytest.mark.parametrize("arch", ARCHS)
def test_completions_equal_transformers_greedy(pool, arch):
    served = pool.get(arch)
    model_dir = str(served.model_dir)
    reasons = set()
    with served.client() as client:
        for prompt in COMPLETION_PROMPTS:
            response = client.completions.create(
                model=served.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body=RETURN_TOKEN_IDS,
            )
            # Completions tokenize with the tokenizer's special tokens (BOS here), like
            # `tokenizer(prompt)`.
            prompt_ids = reference.completion_prompt_ids(model_dir, prompt)
            reasons.add(_check_choice(served, model_dir, response, prompt_ids, f"{arch} {prompt!r}"))
            _check_usage(response, [prompt_ids], f"{arch} {prompt!r}")
    # The fixture's EOS boost is tuned so both ways of ending are exercised.
    assert reasons == {"stop", "length"}, reasons


@pytest.mark.parametrize("arch", ARCHS)
def test_token_id_prompts_equal_transformers_greedy(pool, arch):
    served = pool.get(arch)
    model_dir = str(served.model_dir)
    prompts = [reference.completion_prompt_ids(model_dir, p) for p in COMPLETION_PROMPTS[:3]]
    with served.client() as client:
        for prompt_ids in prompts:
            response = client.completions.create(
                model=served.model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                extra_body=RETURN_TOKEN_IDS,
            )
            _check_choice(served, model_dir, response, prompt_ids, f"{arch} ids {prompt_ids}")
            _check_usage(response, [prompt_ids], f"{arch} ids {prompt_ids}")


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_list_gives_one_choice_per_prompt(pool, arch):
    """A list of prompts (strings or token-id lists) is answered with one choice per prompt, in
    order, each equal to the reference."""
    served = pool.get(arch)
    model_dir = str(served.model_dir)
    texts = COMPLETION_PROMPTS[3:6]
    ids = [reference.completion_prompt_ids(model_dir, p) for p in texts]
    with served.client() as client:
        for prompt in (texts, ids):
            response = client.completions.create(
                model=served.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body=RETURN_TOKEN_IDS,
            )
            assert len(response.choices) == len(texts)
            for index, prompt_ids in enumerate(ids):
                _check_choice(served, model_dir, response, prompt_ids, f"{arch} list #{index}", index)
            _check_usage(response, ids, f"{arch} list")


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_equals_transformers_greedy(pool, arch):
    served = pool.get(arch)
    model_dir = str(served.model_dir)
    with served.client() as client:
        for messages in CHATS:
            response = client.chat.completions.create(
                model=served.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body=RETURN_TOKEN_IDS,
            )
            assert response.choices[0].message.role == "assistant"
            # The rendered template already holds BOS: apply_chat_template does not add another.
            prompt_ids = reference.chat_prompt_ids(model_dir, messages)
            _check_choice(served, model_dir, response, prompt_ids, f"{arch} chat {messages}")
            _check_usage(response, [prompt_ids], f"{arch} chat {messages}")
