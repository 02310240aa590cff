"""The scheduler's paths over a model split in two (`--num-shard 2`, gloo on CPU): a prefix cached by
an earlier request, prompts prefilled in chunks beside running streams, streams preempted and
resumed by recomputation, and grammar-constrained rows. Each request's greedy tokens are
transformers' and peft's on the same weights; the counters show that each path was taken."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai
import pytest

import reference
from adapter_models import SERVED_NAME, adapter_set, greedy_with, start_stack
from served import RETURN_TOKEN_IDS, token_ids
from structured_checks import json_schema_format, load_schema, validate

BLOCK = 16
PREFILL_BUDGET = 32  # tokens per prefill step: longer prompts go in chunks
KV_TOKENS = 640  # the whole cache: two long streams fill it
ADAPTER = "kinds/every-linear"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "tp-scheduling", extra_args=[
        "--num-shard", "2", "--max-batch-prefill-tokens", str(PREFILL_BUDGET),
        "--max-batch-total-tokens", str(KV_TOKENS), "--preemption-wait-ms", "50"])
    yield adapters, stack
    stack.stop()


def _ids(seed: int, count: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, vocab) for _ in range(count)]


def _vocab(adapters) -> int:
    return len(reference.load_tokenizer(str(adapters.base_dir)))


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def _complete(client: openai.AsyncOpenAI, model: str | None, prompt: list[int], max_tokens: int,
                    **extra: Any):
    return await client.completions.create(
        model=model or SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={**RETURN_TOKEN_IDS, **extra})


def _burst(stack, requests: list[tuple[str | None, list[int], int, dict[str, Any]]]) -> list[Any]:
    """Greedy completions (model, prompt ids, max_tokens, extra body fields), sent at once."""
    async def burst() -> list[Any]:
        async with _client(stack) as client:
            return await asyncio.gather(*(_complete(client, model, prompt, max_tokens, **extra)
                                          for model, prompt, max_tokens, extra in requests))

    return asyncio.run(burst())


def _check(adapters, model: str | None, prompt: list[int], response, max_tokens: int, what: str,
           stop_at_eos: bool = True) -> None:
    want = greedy_with(adapters.base_dir, None if model is None else adapters.adapter_dir(model), prompt, max_tokens,
                       stop_at_eos)
    reference.assert_greedy_parity(token_ids(response), want, what)


@pytest.mark.parametrize("model", [None, ADAPTER])
def test_a_cached_prefix_is_reused_over_two_ranks(served, model) -> None:
    adapters, stack = served
    vocab = _vocab(adapters)
    seed = 1 if model is None else 2
    first = _ids(seed, 3 * BLOCK, vocab)
    longer = first + _ids(seed + 10, 20, vocab)
    responses = [_burst(stack, [(model, prompt, 8, {})])[0] for prompt in (first, longer)]
    details = responses[1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 2 * BLOCK, responses[1].usage
    for prompt, response in zip((first, longer), responses, strict=True):
        _check(adapters, model, prompt, response, 8, f"{model or 'base'}, cached prefix")


def test_long_prompts_prefill_in_chunks_beside_running_streams(served) -> None:
    adapters, stack = served
    vocab = _vocab(adapters)
    prompts = [(model, _ids(20 + i, 100 + 7 * i, vocab)) for i, model in enumerate([None, ADAPTER, None])]

    responses = _burst(stack, [(model, prompt, 10, {}) for model, prompt in prompts])
    for (model, prompt), response in zip(prompts, responses, strict=True):
        assert response.usage.prompt_tokens == len(prompt) > PREFILL_BUDGET
        _check(adapters, model, prompt, response, 10, f"{model or 'base'}, {len(prompt)}-token prompt in chunks")


def test_preempted_streams_resume_with_the_same_tokens(served) -> None:
    """Three requests that each reserve half the cache: the third waits, and preempts one of the
    two running streams, which later resumes by recomputation over both ranks."""
    adapters, stack = served
    vocab = _vocab(adapters)
    prompt_len = 12
    max_tokens = KV_TOKENS // 2 - prompt_len
    jobs = [(model, _ids(40 + i, prompt_len, vocab)) for i, model in enumerate([None, ADAPTER, None])]
    before = stack.metrics().get("quiver_preemptions_total", 0.0)

    responses = _burst(stack, [(model, prompt, max_tokens, {"ignore_eos": True}) for model, prompt in jobs])
    assert stack.metrics().get("quiver_preemptions_total", 0.0) > before
    for (model, prompt), response in zip(jobs, responses, strict=True):
        assert len(token_ids(response)) == max_tokens
        _check(adapters, model, prompt, response, max_tokens, f"{model or 'base'}, preempted burst",
               stop_at_eos=False)


@pytest.mark.parametrize("model", [None, ADAPTER])
def test_grammar_constrained_rows_over_two_ranks(served, model) -> None:
    """Both ranks mask every step's logits with the request's grammar: the JSON validates, and
    free greedy requests in the same batch keep transformers' tokens."""
    adapters, stack = served
    vocab = _vocab(adapters)
    schema = load_schema("person")
    free_prompt = _ids(60, 9, vocab)

    async def burst():
        async with _client(stack) as client:
            constrained = client.chat.completions.create(
                model=model or SERVED_NAME, messages=[{"role": "user", "content": "Answer in JSON."}],
                max_tokens=200, temperature=0, extra_body={"response_format": json_schema_format("person", schema)})
            return await asyncio.gather(constrained, _complete(client, model, free_prompt, 10))

    constrained, free = asyncio.run(burst())
    assert constrained.choices[0].finish_reason == "stop", constrained
    validate(schema, constrained.choices[0].message.content or "")
    _check(adapters, model, free_prompt, free, 10, f"{model or 'base'}, free beside a grammar")
