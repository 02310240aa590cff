"""Random quantized weights for the quantized-matmul kernel tests (CPU, AMX, Triton): values over
the whole range of their width, positive scales, offsets around zero; and the prefill of every
position that the quantized-model tests hold to transformers."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quiver_server.engine.forward_batch import build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.quant.weights import QuantizedWeight


def write_checkpoint(out: Path, config: dict[str, Any], files: dict[str, dict[str, torch.Tensor]]) -> None:
    """A safetensors checkpoint in several files with its index, under config.json `config`."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for file, tensors in files.items():
        save_file(tensors, str(out / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def random_weight(out: int, inp: int, bits: int, group: int, offsets: bool, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    groups = (out, inp // group)
    scales = torch.rand(groups, generator=gen) * 0.02 + 1e-3
    offs = (torch.randn(groups, generator=gen) * 0.1) if offsets else None
    return QuantizedWeight(bits, q, scales, offs, group)


@dataclass
class PrefillRun:
    """One prefill of `prompts` on a model, with the logits of every position."""

    logits: list[torch.Tensor]  # per prompt, [len, vocab], on the CPU
    kv_cache: PagedKVCache
    table: torch.Tensor  # [prompts, blocks each], for decode steps after it


def prefill_every_position(model: DecoderForCausalLM, prompts: list[list[int]], spare_tokens: int,
                           device: torch.device) -> PrefillRun:
    """A float32 KV cache with room for `spare_tokens` more tokens per prompt, the prompts
    prefilled in one flat batch, and the logits of every position (as transformers returns them)."""
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    blocks_each = spec.blocks_for_tokens(max(len(p) for p in prompts) + spare_tokens)
    kv_cache = PagedKVCache(spec, blocks_each * len(prompts), device)
    table = torch.arange(blocks_each * len(prompts)).view(len(prompts), blocks_each)
    lens = [len(p) for p in prompts]
    batch = build_prefill(lens, table, BLOCK_SIZE, device)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens), device=device))
    logits = model(torch.tensor([t for p in prompts for t in p], device=device), batch, kv_cache).cpu()
    return PrefillRun(list(logits.split(lens)), kv_cache, table)
