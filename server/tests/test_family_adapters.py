"""LoRA on every served family against peft: for each family, peft-written adapters (one on
every module the family serves LoRA on, including Phi-3's fused qkv_proj and gate_up_proj as
PEFT targets them and a sparse model's router and experts as PEFT's "all-linear" targets them,
per-module ranks included; one on attention only; for sparse models one on every expert as
transformers 4 named them) and the base model in one mixed batch give the logits peft gives
each sequence alone, in prefill and in decode over the paged cache."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch
from device import TEST_DEVICE
from tiny_adapters import build_adapter, build_legacy_expert_adapter, peft_reference
from tiny_models import build_tiny_model

from quiver_server.engine.engine import Engine
from quiver_server.engine.forward_batch import build_decode, build_lora_meta, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, PagedKVCache
from quiver_server.models import family_for
from quiver_server.weights import load_config

ATOL = 1e-4
MAX_RANK = 16

# family case -> (architecture, config overrides)
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                            "logits_scaling": 2.0}),
}


@dataclasses.dataclass
class Family:
    engine: Engine
    references: dict[str | None, torch.nn.Module]  # adapter id (None: base) -> peft / transformers


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    arch, overrides = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = build_tiny_model(root / "base", arch, seed=4, **overrides)
    targets = list(family_for(load_config(base)).layout.lora_targets)
    attention = [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")]
    sparse = "experts.gate_proj" in targets
    # PEFT's all-linear on a sparse model: attention modules, and target_parameters on the
    # router and the fused experts, gate|up at twice the rank (rank_pattern, alpha_pattern).
    every = "all-linear" if sparse else targets
    adapters = {
        "every-target": build_adapter(base, root / "every", seed=21, r=4, lora_alpha=16, target_modules=every),
        "attention": build_adapter(base, root / "attention", seed=22, r=4, lora_alpha=8, target_modules=attention,
                                   use_rslora=True),
    }
    expected_targets = {"every-target": targets, "attention": attention}
    if sparse:
        adapters["experts"] = build_legacy_expert_adapter(base, root / "experts", seed=23, r=6, lora_alpha=12)
        expected_targets["experts"] = [t for t in targets if t.startswith("experts.")]
    # A small share of a GPU: each family's engine sizes its KV cache from what is free.
    engine = Engine(str(base), "tiny", dtype="float32", device=str(TEST_DEVICE), cpu_kv_cache_gib=0.01,
                    gpu_memory_fraction=0.2)
    engine.warmup(256, 128, 16, max_active_adapters=len(adapters), max_lora_rank=MAX_RANK)
    for slot, (name, path) in enumerate(adapters.items()):
        info = engine.lora.load(name, "local", str(path))
        assert set(info.target_modules) == set(expected_targets[name])
        engine.activate_adapter(name, slot)
    references = {name: peft_reference(base, path) for name, path in adapters.items()}
    references[None] = peft_reference(base, None)
    yield Family(engine, references)
    # A failed test's traceback keeps the engine alive: its cache must not starve the next family's.
    engine.kv_cache = None
    if TEST_DEVICE.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def test_mixed_adapters_and_base_equal_peft(family: Family) -> None:
    engine = family.engine
    kinds: list[str | None] = [None, "every-target", "attention", "every-target"]
    if "experts" in family.references:
        kinds.append("experts")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in kinds]
    slots = [-1 if k is None else engine.lora.slots.slot_of(k) for k in kinds]  # type: ignore[union-attr]
    lens = [len(p) for p in prompts]
    blocks_each = -(-(max(lens) + 4) // BLOCK_SIZE)
    cache = PagedKVCache(engine.kv_spec, blocks_each * len(kinds), engine.device)
    table = torch.arange(blocks_each * len(kinds), device=engine.device).view(len(kinds), blocks_each)

    batch = build_prefill(lens, table, BLOCK_SIZE, engine.device, slots, MAX_RANK)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens), device=engine.device),
                                lora_rows=batch.lora)
    flat = torch.tensor([t for p in prompts for t in p], device=engine.device)
    logits = engine.model(flat, batch, cache).cpu().split(lens)
    for kind, prompt, ours in zip(kinds, prompts, logits, strict=True):
        expected = family.references[kind](torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0, msg=lambda m, k=kind: f"{k}: {m}")
    # The adapters matter: each moves the logits well away from the base model's.
    base = family.references[None](torch.tensor([prompts[1]])).logits[0]
    for kind in (k for k in family.references if k is not None):
        adapted = family.references[kind](torch.tensor([prompts[1]])).logits[0]
        assert float((adapted - base).abs().max()) > 0.05, kind

    sequences = [list(p) for p in prompts]
    decode_lora = build_lora_meta(slots, [1] * len(slots), MAX_RANK, engine.device)
    for step in range(3):
        fed = [(13 * step + 7 * i + 5) % 300 for i in range(len(kinds))]
        batch = build_decode([len(s) for s in sequences], table, BLOCK_SIZE, engine.device, decode_lora)
        logits = engine.model(torch.tensor(fed, device=engine.device), batch, cache).cpu()
        for i, (kind, token) in enumerate(zip(kinds, fed, strict=True)):
            sequences[i].append(token)
            expected = family.references[kind](torch.tensor([sequences[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0, msg=lambda m, k=kind: f"{k}: {m}")
