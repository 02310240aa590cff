"""The Triton ops as a whole model runs them (compiled on a GPU when there is one, else in Triton's
CPU interpreter): paged prefill
and decode attention, fresh and cached prompts, windows and soft-caps, the row ops (RMSNorm,
rotary with the KV write, partial rotary, the gated activation), against transformers on the
same weights, as the model parity tests hold the CPU and torch ops."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import build_tiny_model

from quiver_server.engine.forward_batch import build_decode, build_mixed, build_prefill
from quiver_server.kernels.ops import TritonKernelOps
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.models import load_model
from quiver_server.weights import load_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = 1e-4
CASES = {
    "llama": ("llama", {}),
    "gemma2-caps-window": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0,
                                      "final_logit_softcapping": 3.0}),
    "qwen3-moe": ("qwen3_moe", {}),
    "phi4-mini-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    return build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=7, **overrides)


@torch.inference_mode()
def test_prefill_cached_prefill_and_decode_equal_transformers(case: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    model = load_model(case, load_config(case), torch.float32, DEVICE, TritonKernelOps(DEVICE, "torch", None))
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 21, 34)]
    blocks_each = spec.blocks_for_tokens(max(map(len, prompts)) + 2)
    cache = PagedKVCache(spec, blocks_each * len(prompts), DEVICE)
    table = torch.randperm(blocks_each * len(prompts), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    table = table.view(len(prompts), blocks_each)

    # The first two prompts whole, the third's first 20 tokens as a chunk (no logits wanted).
    first = [prompts[0], prompts[1], prompts[2][:20]]
    lens = [len(p) for p in first]
    batch = build_prefill(lens, table, BLOCK_SIZE, DEVICE, sampled=[True, True, False])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(lens[0] + lens[1], device=DEVICE))
    logits = model(torch.tensor([t for p in first for t in p], device=DEVICE), batch, cache).cpu().split(lens[:2])
    for prompt, ours in zip(prompts[:2], logits, strict=True):
        torch.testing.assert_close(ours, reference(torch.tensor([prompt])).logits[0], atol=ATOL, rtol=0)
    # The rest of the third prompt over its cached first 20 tokens.
    rest = prompts[2][20:]
    batch = build_prefill([len(rest)], table[2:], BLOCK_SIZE, DEVICE, context_lens=[20])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(rest), device=DEVICE))
    ours = model(torch.tensor(rest, device=DEVICE), batch, cache).cpu()
    torch.testing.assert_close(ours, reference(torch.tensor([prompts[2]])).logits[0, 20:], atol=ATOL, rtol=0)

    sequences = [list(p) for p in prompts]
    for step in range(2):
        fed = [(5 * step + 7 * i + 3) % cfg.vocab_size for i in range(len(sequences))]
        batch = build_decode([len(s) for s in sequences], table, BLOCK_SIZE, DEVICE)
        logits = model(torch.tensor(fed, device=DEVICE), batch, cache).cpu()
        for i, token in enumerate(fed):
            sequences[i].append(token)
            expected = reference(torch.tensor([sequences[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


@torch.inference_mode()
def test_a_mixed_pass_equals_transformers(case: Path) -> None:
    """Two decoding sequences and a fresh prompt's prefill in one pass (`build_mixed`): the
    prompt rows through the paged prefill kernel, the decode rows through the decode kernel."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    model = load_model(case, load_config(case), torch.float32, DEVICE, TritonKernelOps(DEVICE, "torch", None))
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (13, 26, 19)]
    blocks_each = spec.blocks_for_tokens(max(map(len, prompts)) + 2)
    cache = PagedKVCache(spec, blocks_each * len(prompts), DEVICE)
    table = torch.randperm(blocks_each * len(prompts), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    table = table.view(len(prompts), blocks_each)
    running = prompts[:2]
    lens = [len(p) for p in running]
    model(torch.tensor([t for p in running for t in p], device=DEVICE),
          build_prefill(lens, table[:2], BLOCK_SIZE, DEVICE), cache)

    fed = [7, 11]
    head = build_prefill([len(prompts[2])], table[2:], BLOCK_SIZE, DEVICE)
    tail = build_decode(lens, table[:2], BLOCK_SIZE, DEVICE)
    batch = build_mixed(head, [1], [-1], tail, [-1, -1], 0, DEVICE)
    logits = model(torch.tensor(prompts[2] + fed, device=DEVICE), batch, cache).cpu()
    assert logits.shape[0] == 3
    torch.testing.assert_close(logits[0], reference(torch.tensor([prompts[2]])).logits[0, -1], atol=ATOL, rtol=0)
    for row, (prompt, token) in enumerate(zip(running, fed, strict=True), start=1):
        expected = reference(torch.tensor([prompt + [token]])).logits[0, -1]
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)
