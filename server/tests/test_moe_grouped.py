"""The sparse MLP's grouped expert matmul against one plain matmul per expert, and its routing
against transformers' Qwen3-MoE and Mixtral blocks on the same weights, on the test device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from device import TEST_DEVICE
from tiny_models import build_tiny_model

from quiver_server.engine.engine import Engine
from quiver_server.kernels.ops import select_ops
from quiver_server.models.mixture import MixtralForCausalLM, Qwen3MoeForCausalLM
from quiver_server.layers.grouped_linear import grouped_linear, has_grouped_mm, host_sync_free
from quiver_server.models.moe import SparseMoe

DTYPES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_grouped_linear_equals_a_matmul_per_expert(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    counts = [5, 0, 17, 1, 0, 9]  # empty experts too
    x = torch.randn(sum(counts), 64, generator=generator).to(TEST_DEVICE, dtype)
    weight = (torch.randn(len(counts), 48, 64, generator=generator) / 8).to(TEST_DEVICE, dtype)
    offsets = torch.tensor(counts).cumsum(0).to(TEST_DEVICE, torch.int32)
    out = grouped_linear(x, weight, offsets)
    start = 0
    for expert, count in enumerate(counts):
        expected = torch.nn.functional.linear(x[start:start + count].float(), weight[expert].float())
        torch.testing.assert_close(out[start:start + count].float(), expected, atol=DTYPES[dtype], rtol=DTYPES[dtype])
        start += count


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@torch.inference_mode()
def test_sparse_moe_block_equals_transformers(arch: str) -> None:
    """The whole block (router softmax, top-k, renormalisation, experts) in float32 against
    transformers' own sparse MoE block holding the same weights, on 200 tokens."""
    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300, "num_experts_per_tok": 2}
    if arch == "qwen3_moe":
        hf_config = transformers.Qwen3MoeConfig(**shape, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config)
        family: type = Qwen3MoeForCausalLM
    else:
        hf_config = transformers.MixtralConfig(**shape, num_local_experts=8)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(hf_config)
        family = MixtralForCausalLM
    generator = torch.Generator().manual_seed(2)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    cfg = family.config_from_hf(hf_config.to_dict())
    ours = SparseMoe(cfg, select_ops(TEST_DEVICE)).to(TEST_DEVICE)
    ours.gate.weight.data.copy_(block.gate.weight)
    ours.gate_up.weight.data.copy_(block.experts.gate_up_proj)
    ours.down.weight.data.copy_(block.experts.down_proj)
    x = torch.randn(1, 200, 64, generator=generator)
    expected = block(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    got = ours(x[0].to(TEST_DEVICE), SimpleNamespace(lora=None)).cpu()  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_only_where_the_experts_never_read_the_device(dtype: str, tmp_path) -> None:
    """The per-expert fallback reads the group sizes on the host, which a CUDA graph capture
    refuses: an engine captures decode graphs for a sparse model only where the grouped kernel
    runs (on CUDA, 16-bit), and its warmup succeeds either way."""
    model_dir = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3)
    engine = Engine(str(model_dir), "moe", dtype=dtype, device=str(TEST_DEVICE), cpu_kv_cache_gib=0.01,
                    gpu_memory_fraction=0.2)
    try:
        sync_free = host_sync_free((m for _, m in engine.model.named_modules()), engine.device, engine.dtype)
        if TEST_DEVICE.type == "cuda":  # torch's CUTLASS grouped kernel: bfloat16 on sm90/sm100
            fast = dtype == "bfloat16" and torch.cuda.get_device_capability(TEST_DEVICE)[0] in (9, 10)
            assert sync_free == (fast and has_grouped_mm(engine.device, engine.dtype))
        else:
            assert sync_free  # nothing to capture
        assert engine.use_cuda_graphs == (TEST_DEVICE.type == "cuda" and sync_free)
        engine.warmup(64, 64, 4)
        assert (engine.graphs is not None) == engine.use_cuda_graphs
    finally:
        engine.kv_cache = engine.graphs = None
        if TEST_DEVICE.type == "cuda":
            torch.cuda.empty_cache()
