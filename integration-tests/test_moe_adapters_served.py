"""LoRA on a sparse model's router and experts, served end to end: Qwen3-MoE and Mixtral with an
adapter peft wrote with `target_modules="all-linear"` (attention, the router and the fused
experts through `target_parameters`, gate|up at twice the rank), requests on it and on the base
sent at once so they share batches and grouped expert matmuls, every greedy output equal to
peft's, token for token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import reference
from adapter_models import build_adapter, greedy_with
from conftest import SHARD_ENV
from model_builders import build_model_dir, family_chat_template
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids
from stack import Stack, StackConfig

MAX_TOKENS = 12
ADAPTER = "experts/all-linear"
CHATS: list[list[Any]] = [[{"role": "user", "content": "Hello!"}], [{"role": "user", "content": "Name a city, 東京?"}]]


class MoeStack:
    def __init__(self, base_dir: Path, root: Path, stack: Stack) -> None:
        self.base_dir, self.root, self.stack = base_dir, root, stack


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoeStack]:
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    base_dir = build_model_dir(arch, tmp / "base", seed=41, eos_boost=2.5, chat_template=family_chat_template(arch))
    root = tmp / "adapters"
    build_adapter(base_dir, root / ADAPTER, seed=42, r=4, lora_alpha=8, target_modules="all-linear")
    config = StackConfig(model_id=str(base_dir), served_model_name=f"tiny-{arch}", max_total_tokens=512,
                         extra_args=["--adapter-source", "local", "--adapter-root", str(root), "--max-lora-rank", "16"],
                         extra_env=SHARD_ENV)
    stack = Stack(config, tmp / "stack.log").start()
    yield MoeStack(base_dir, root, stack)
    stack.stop()


def test_router_and_expert_lora_mixed_with_the_base_equals_peft(moe: MoeStack) -> None:
    served = str(moe.stack.config.served_model_name)
    requests = [(model, chat) for chat in CHATS for model in (served, ADAPTER)] * 2

    async def send_all() -> list:
        async with openai.AsyncOpenAI(base_url=moe.stack.base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(
                client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=RETURN_TOKEN_IDS)
                for model, chat in requests))

    responses = asyncio.run(send_all())
    outputs: dict[str, list[list[int]]] = {}
    for (model, chat), response in zip(requests, responses, strict=True):
        prompt_ids = reference.chat_prompt_ids(str(moe.base_dir), chat)
        assert prompt_token_ids(response) == prompt_ids
        adapter_dir = moe.root / ADAPTER if model == ADAPTER else None
        expected = greedy_with(moe.base_dir, adapter_dir, prompt_ids, MAX_TOKENS)
        reference.assert_greedy_parity(token_ids(response), expected, f"{model} {chat}")
        outputs.setdefault(model, []).append(token_ids(response))
    # The adapter matters: its tokens differ from the base's.
    assert outputs[ADAPTER] != outputs[served]
