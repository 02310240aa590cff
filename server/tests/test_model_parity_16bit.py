"""Every family served in bfloat16 and float16 against transformers.

In 16 bits no two implementations agree to 1e-4: they round at different places. The reference
is therefore transformers in float32 on the same weights (DESIGN.md's correctness rule), and
the bar is transformers' own 16-bit run: our logits may stray from the float32 reference by at
most a small multiple of what transformers' logits in the same dtype stray by, in prefill over
the paged cache and in decode steps that read it back. A real error (a wrong norm, a dropped
cap, a misplaced cast) moves logits by far more than either run's rounding.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
import transformers
from device import TEST_DEVICE
from tiny_models import build_tiny_model

from quiver_server.engine.forward_batch import build_decode, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.models import load_model
from quiver_server.weights import load_config

PROMPT_LENGTHS = (5, 17, 33)
DECODE_STEPS = 3
# Our deviation from float32 may be this many times transformers' own, plus this much.
RATIO, FLOOR = 3.0, {torch.bfloat16: 2e-2, torch.float16: 3e-3}

FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.75}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                            "logits_scaling": 2.0}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = FAMILIES[request.param]
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=31, **overrides)


def _reference(path: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@torch.inference_mode()
def test_16bit_logits_stray_from_float32_no_more_than_transformers(family: Path, dtype: torch.dtype) -> None:
    exact, rounded = _reference(family, torch.float32), _reference(family, dtype)
    model = load_model(family, load_config(family), dtype, TEST_DEVICE)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, BLOCK_SIZE)
    blocks_each = spec.blocks_for_tokens(max(PROMPT_LENGTHS) + DECODE_STEPS)
    kv_cache = PagedKVCache(spec, blocks_each * len(PROMPT_LENGTHS), TEST_DEVICE)
    table = torch.arange(blocks_each * len(PROMPT_LENGTHS)).view(len(PROMPT_LENGTHS), blocks_each)
    rng = random.Random(3)
    sequences = [[rng.randrange(3, 300) for _ in range(n)] for n in PROMPT_LENGTHS]

    ours_error = theirs_error = 0.0

    def compare(ours: torch.Tensor, tokens: list[int], rows: slice) -> None:
        nonlocal ours_error, theirs_error
        ids = torch.tensor([tokens])
        want = exact(ids).logits[0, rows]
        ours_error = max(ours_error, float((ours.float() - want).abs().max()))
        theirs_error = max(theirs_error, float((rounded(ids).logits[0, rows].float() - want).abs().max()))

    lens = list(PROMPT_LENGTHS)
    batch = build_prefill(lens, table, BLOCK_SIZE, TEST_DEVICE)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens), device=TEST_DEVICE))
    flat = torch.tensor([t for s in sequences for t in s], device=TEST_DEVICE)
    for logits, tokens in zip(model(flat, batch, kv_cache).cpu().split(lens), sequences, strict=True):
        compare(logits, tokens, slice(None))
    for step in range(DECODE_STEPS):
        fed = [(7 * step + 11 * i + 3) % cfg.vocab_size for i in range(len(sequences))]
        batch = build_decode([len(s) for s in sequences], table.to(TEST_DEVICE), BLOCK_SIZE, TEST_DEVICE)
        logits = model(torch.tensor(fed, device=TEST_DEVICE), batch, kv_cache).cpu()
        for i, token in enumerate(fed):
            sequences[i].append(token)
            compare(logits[i], sequences[i], slice(-1, None))
    assert ours_error <= RATIO * theirs_error + FLOOR[dtype], (
        f"{dtype}: ours {ours_error:.4g} from float32, transformers' {theirs_error:.4g}")
