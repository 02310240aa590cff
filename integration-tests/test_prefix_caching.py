"""Prefix caching and chunked prefill through the whole stack, against transformers' greedy
output on the same weights: a prompt that shares its first blocks with an earlier one reports
them in `usage.prompt_tokens_details.cached_tokens` (and in the hit counters of /metrics) and
still generates exactly transformers' tokens; a server with a tiny prefill budget computes long
prompts in chunks, between the decode steps of running streams, with the same tokens; an adapter
unloaded, rewritten with new weights and loaded again under its name reuses none of the old
weights' blocks and generates peft's tokens for the new ones."""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import reference
from adapter_models import ADAPTER_KINDS, BASE_SEED, build_adapter, greedy_with, start_adapter_stack
from conftest import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS, SHARD_ENV
from model_builders import build_model_dir
from served import RETURN_TOKEN_IDS, token_ids
from stack import Stack, StackConfig
from tenant_keys import poll

BLOCK = 16  # the shard's KV block size
MAX_TOKENS = 12


def _ids(seed: int, count: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    # Above the special tokens, below the vocabulary's end.
    return [rng.randrange(8, vocab) for _ in range(count)]


def _vocab(model_dir: str) -> int:
    return len(reference.load_tokenizer(model_dir))


def _complete(client: openai.OpenAI, model: str, prompt: list[int]):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS,
    )


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details
    assert details is not None, "usage has no prompt_tokens_details"
    return details.cached_tokens


def _check(model_dir: str, response, prompt: list[int], context: str) -> None:
    assert response.usage.prompt_tokens == len(prompt), context
    reference.assert_greedy_parity(token_ids(response), reference.greedy(model_dir, prompt, MAX_TOKENS), context)


def _counters(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    wanted = {"quiver_prefix_cache_queries", "quiver_prefix_cache_hits"}
    return {
        family.name: family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.name in wanted
    }


def test_a_shared_prefix_is_reused_and_the_output_is_unchanged(llama):
    model_dir = str(llama.model_dir)
    vocab = _vocab(model_dir)
    prefix = _ids(1, 40, vocab)
    first = prefix + _ids(2, 7, vocab)
    second = prefix + _ids(3, 9, vocab)
    before = _counters(llama.stack.base_url)
    with llama.client() as client:
        a = _complete(client, llama.model, first)
        b = _complete(client, llama.model, second)
        again = _complete(client, llama.model, second)
    _check(model_dir, a, first, "first prompt")
    _check(model_dir, b, second, "prompt sharing 40 tokens")
    _check(model_dir, again, second, "the same prompt again")
    assert _cached(a) == 0
    # The 40 shared tokens hold two full blocks; the repeated prompt has all its full blocks
    # cached but the one of its last token, which is computed to give the first token's logits.
    assert _cached(b) == 2 * BLOCK
    assert _cached(again) == (len(second) - 1) // BLOCK * BLOCK
    after = _counters(llama.stack.base_url)
    assert after["quiver_prefix_cache_queries"] - before["quiver_prefix_cache_queries"] == len(first) + 2 * len(second)
    assert after["quiver_prefix_cache_hits"] - before["quiver_prefix_cache_hits"] == _cached(b) + _cached(again)


def test_chat_usage_reports_cached_tokens_of_a_repeated_system_prompt(llama):
    model_dir = str(llama.model_dir)
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    with llama.client() as client:
        responses = [
            client.chat.completions.create(
                model=llama.model, messages=[system, {"role": "user", "content": question}],
                max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS,
            )
            for question in ["Name a city.", "Name a river."]
        ]
    prompts = [reference.chat_prompt_ids(model_dir, [system, {"role": "user", "content": q}])
               for q in ["Name a city.", "Name a river."]]
    shared = next(i for i, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)
    assert shared >= BLOCK, "the test's system prompt must fill a block"
    assert _cached(responses[0]) == 0
    assert _cached(responses[1]) == shared // BLOCK * BLOCK
    for response, prompt in zip(responses, prompts, strict=True):
        assert response.usage.prompt_tokens == len(prompt)
        reference.assert_greedy_parity(
            token_ids(response), reference.greedy(model_dir, prompt, MAX_TOKENS), "chat with a cached system prompt"
        )


@pytest.fixture(scope="module")
def chunking(pool, tmp_path_factory):
    """llama served with a 16-token prefill budget and no prefix caching: every prompt longer
    than 16 tokens is computed in chunks, and nothing is reused."""
    model_dir = pool.model_dir("llama")
    config = StackConfig(
        model_id=str(model_dir), served_model_name="tiny-llama", max_input_tokens=MAX_INPUT_TOKENS,
        max_total_tokens=MAX_TOTAL_TOKENS, max_batch_prefill_tokens=16, extra_env=SHARD_ENV,
        extra_args=["--prefix-caching", "false", "--chunked-prefill", "true"],
    )
    with Stack(config, tmp_path_factory.mktemp("logs") / "chunked.log") as stack:
        yield stack, str(model_dir)


def test_chunked_prompts_generate_transformers_tokens_beside_running_streams(chunking):
    stack, model_dir = chunking
    vocab = _vocab(model_dir)
    prompts = [_ids(10 + i, length, vocab) for i, length in enumerate([5, 70, 150, 33, 201])]
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    with client, ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: _complete(client, "tiny-llama", p), prompts))
        repeat = _complete(client, "tiny-llama", prompts[2])
    for prompt, response in zip(prompts, responses, strict=True):
        _check(model_dir, response, prompt, f"{len(prompt)}-token prompt in 16-token chunks")
        assert _cached(response) == 0
    assert _cached(repeat) == 0, "--prefix-caching false reuses nothing"
    assert token_ids(repeat) == token_ids(responses[2])
    counters = _counters(stack.base_url)
    assert counters["quiver_prefix_cache_hits"] == 0
    # 614 prompt tokens computed, at most 16 in a step.
    page = httpx.get(stack.base_url + "/metrics", timeout=30).text
    prefill_steps = next(
        family.samples[0].value for family in text_string_to_metric_families(page)
        if family.name == "quiver_prefill_steps"
    )
    computed = sum(map(len, prompts)) + len(prompts[2])
    assert prefill_steps >= -(-computed // 16)


def test_an_adapter_reloaded_with_new_weights_reuses_none_of_the_old_blocks(tmp_path: Path):
    base = build_model_dir("llama", tmp_path / "base", seed=BASE_SEED)
    # Both weight sets are written by peft; the served directory gets the old, then the new.
    old = build_adapter(base, tmp_path / "weights" / "old", seed=710, **ADAPTER_KINDS["rank8"])
    new = build_adapter(base, tmp_path / "weights" / "new", seed=711, **ADAPTER_KINDS["rank8"])
    root = tmp_path / "root"
    name = "team/reloaded"
    shutil.copytree(old, root / name)
    prompt = _ids(20, 3 * BLOCK + 5, _vocab(str(base)))
    want_old = greedy_with(base, old, prompt, MAX_TOKENS)
    want_new = greedy_with(base, new, prompt, MAX_TOKENS)
    assert want_old.token_ids != want_new.token_ids, "the weight sets must differ in their tokens"
    full = (len(prompt) - 1) // BLOCK * BLOCK

    def load() -> None:
        # An unload answers once new requests are refused; until the shards have forgotten the
        # adapter, a load of its name is refused as "being unloaded". Asked again until then.
        def loaded() -> bool:
            status, body = stack.post_raw("/v1/load_lora_adapter",
                                          json.dumps({"lora_name": name, "lora_path": name}).encode())
            if status == 404 and b"is being unloaded" in body:
                return False
            assert status == 200, body
            return True

        poll(loaded, f"{name} to load")

    stack = start_adapter_stack(base, root, tmp_path, "reloaded", extra_args=["--prefix-caching", "true"])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with client:
            load()
            first, again = _complete(client, name, prompt), _complete(client, name, prompt)
            assert (_cached(first), _cached(again)) == (0, full)
            for response in (first, again):
                reference.assert_greedy_parity(token_ids(response), want_old, "the old weights")

            status, body = stack.post_raw("/v1/unload_lora_adapter", json.dumps({"lora_name": name}).encode())
            assert status == 200, body
            shutil.copytree(new, root / name, dirs_exist_ok=True)
            load()
            before = _counters(stack.base_url)
            reloaded = _complete(client, name, prompt)
            after = _counters(stack.base_url)
            repeat = _complete(client, name, prompt)
        assert _cached(reloaded) == 0, "the reloaded adapter reused blocks of the old weights"
        assert after["quiver_prefix_cache_hits"] == before["quiver_prefix_cache_hits"]
        assert _cached(repeat) == full, "the new weights' blocks are cached as any others"
        for response in (reloaded, repeat):
            reference.assert_greedy_parity(token_ids(response), want_new, "the new weights")
    finally:
        stack.stop()
