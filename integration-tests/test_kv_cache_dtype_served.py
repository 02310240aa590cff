"""`--kv-cache-dtype` through the real launcher: a float32 base with LoRA adapters served over a
float8 (e4m3) and a bfloat16 KV cache, one concurrent burst, equals transformers + peft generating
with a cache that rounds K and V the same way (saturated at the format's largest finite value,
rounded to nearest by torch's cast), token for token. Over float8 the plain float32 reference's
own output differs (checked), so the comparison shows the narrower cache is what is served."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

import reference
from adapter_models import (
    COMPLETION_PROMPTS,
    adapter_set,
    completion_ids,
    greedy_completion_burst,
    greedy_with,
    peft_model,
    start_stack,
)
from served import token_ids

MAX_TOKENS = 12
ADAPTERS = ["kinds/rank8", "kinds/every-linear"]
DTYPES = {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}


class RoundingCache(DynamicCache):
    """transformers' cache, storing (and handing attention) K and V as a `dtype` cache holds them."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__(config=config)
        self.kv_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        limit = torch.finfo(self.kv_dtype).max
        key_states, value_states = (x.clamp(-limit, limit).to(self.kv_dtype).to(x.dtype)
                                    for x in (key_states, value_states))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def rounded_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int],
                   dtype: torch.dtype) -> reference.Greedy:
    model = peft_model(base_dir, adapter_dir)
    config = reference.load_model(base_dir).generation_config
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            past_key_values=RoundingCache(reference.load_model(base_dir).config, dtype), do_sample=False,
            max_new_tokens=MAX_TOKENS, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
            output_logits=True, return_dict_in_generate=True,
        )
    new = out.sequences[0, len(prompt_ids):].tolist()
    return reference.Greedy(token_ids=new, logits=[step[0] for step in out.logits[: len(new)]])


@pytest.fixture(scope="module", params=list(DTYPES))
def served(request, tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), f"kv-{request.param}",
                        extra_args=["--kv-cache-dtype", request.param])
    yield adapters, DTYPES[request.param], stack
    stack.stop()


def test_base_and_adapters_equal_transformers_with_a_rounding_cache(served) -> None:
    adapters, dtype, stack = served
    jobs = [(model, prompt) for model in [None, *ADAPTERS] for prompt in COMPLETION_PROMPTS]
    responses = greedy_completion_burst(stack, jobs, MAX_TOKENS)
    moved = 0
    base_dir = str(adapters.base_dir.resolve())
    for (model, prompt), response in zip(jobs, responses, strict=True):
        prompt_ids = completion_ids(adapters, prompt)
        adapter_dir = None if model is None else adapters.adapter_dir(model)
        want = rounded_greedy(base_dir, None if adapter_dir is None else str(adapter_dir.resolve()), prompt_ids, dtype)
        served_ids = token_ids(response)
        reference.assert_greedy_parity(served_ids, want, f"{model or 'base'} {prompt!r}")
        moved += served_ids != greedy_with(adapters.base_dir, adapter_dir, prompt_ids, MAX_TOKENS).token_ids
    if dtype == torch.float8_e4m3fn:
        # float8's 3 mantissa bits move some greedy tokens of the float32 model.
        assert moved > 0
