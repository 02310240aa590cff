"""A base served with `--quantize int8` / `int4` through the real launcher: greedy output, for the
base and for LoRA adapters on top of it in one concurrent burst, equals transformers + peft on
the dequantized base (quantized_reference.py) token for token — adapters run beside the
quantized projections exactly as peft's do beside the dequantized ones. The float base's own
output differs from it (checked), so the comparison shows the quantized weights are served."""

from __future__ import annotations


import pytest

import reference
from adapter_models import (
    COMPLETION_PROMPTS,
    SERVED_NAME,
    SHARD_ENV,
    adapter_set,
    completion_ids,
    greedy_completion_burst,
    greedy_with,
    start_stack,
)
from quantized_reference import write_dequantized
from served import token_ids
from stack import Stack, StackConfig, StackError

MAX_TOKENS = 12
ADAPTERS = ["kinds/rank8", "kinds/qv-only", "kinds/every-linear"]


@pytest.fixture(scope="module", params=["int8", "int4"])
def served(request, tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    method = request.param
    dequantized = write_dequantized(adapters.base_dir, tmp_path_factory.mktemp(f"dequantized-{method}"), method)
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), f"quantized-{method}",
                        extra_args=["--quantize", method])
    yield adapters, dequantized, stack
    stack.stop()


def test_base_and_adapters_on_a_quantized_base_equal_peft_on_the_dequantized_base(served) -> None:
    adapters, dequantized, stack = served
    jobs = [(model, prompt) for model in [None, *ADAPTERS] for prompt in COMPLETION_PROMPTS]
    responses = greedy_completion_burst(stack, jobs, MAX_TOKENS)
    moved = 0
    for (model, prompt), response in zip(jobs, responses, strict=True):
        prompt_ids = completion_ids(adapters, prompt)
        adapter_dir = None if model is None else adapters.adapter_dir(model)
        want = greedy_with(dequantized, adapter_dir, prompt_ids, MAX_TOKENS)
        served_ids = token_ids(response)
        reference.assert_greedy_parity(served_ids, want, f"{model or 'base'} {prompt!r}")
        moved += served_ids != greedy_with(adapters.base_dir, adapter_dir, prompt_ids, MAX_TOKENS).token_ids
    # Quantization moves some greedy tokens of the float model: the reference is not the float base.
    assert moved > 0


def test_int8_activations_without_quantized_projections_stop_start_up_naming_why(tmp_path_factory) -> None:
    adapters = adapter_set(tmp_path_factory)
    config = StackConfig(model_id=str(adapters.base_dir), served_model_name=SERVED_NAME, max_input_tokens=256,
                         max_total_tokens=512, extra_args=["--quantize-activations", "int8"], extra_env=SHARD_ENV)
    stack = Stack(config, tmp_path_factory.mktemp("logs") / "int8-activations-refused.log")
    with pytest.raises(StackError, match="launcher exited"):
        stack.start()
    assert stack.process.returncode != 0
    assert "--quantize-activations int8 needs quantized projections" in stack.log(), stack.log()
