"""LoRA adapters against peft: every adapter kind (ranks 4 to 64; attention, q/v, MLP, every
linear layer; rsLoRA; regex and layer-filtered targets) gives peft's logits and peft's greedy
tokens, alone and mixed with other adapters and the base model in one batch; with every slot at
rank 64, and with slots in rank classes (8, 16 and 64, interleaved in slot order) each adapter in
the smallest class that holds it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_adapters import (
    ADAPTER_KINDS,
    Reference,
    assert_greedy_matches,
    build_adapter,
    peft_reference,
    reference_greedy,
)
from block_tables import Blocks
from tiny_models import build_tiny_model

from quiver_server.engine.batch_types import RequestSpec, StepResult
from quiver_server.engine.engine import Engine
from quiver_server.engine.forward_batch import build_decode, build_lora_meta, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, PagedKVCache

NEW_TOKENS = 12
ATOL = 1e-4
_rng = random.Random(7)
PROMPTS = {name: [_rng.randrange(3, 300) for _ in range(n)] for name, n in (("short", 7), ("long", 21), ("tiny", 2))}


@dataclass
class Setup:
    base_dir: Path
    adapters: dict[str, Path]  # kind -> directory
    engine: Engine  # every kind active, slot = its index in ADAPTER_KINDS
    _models: dict[str | None, torch.nn.Module] = dataclasses.field(default_factory=dict)
    _greedy: dict[tuple[str | None, str], Reference] = dataclasses.field(default_factory=dict)

    def reference_model(self, kind: str | None) -> torch.nn.Module:
        if kind not in self._models:
            self._models[kind] = peft_reference(self.base_dir, None if kind is None else self.adapters[kind])
        return self._models[kind]

    def greedy(self, kind: str | None, prompt: str) -> Reference:
        if (kind, prompt) not in self._greedy:
            self._greedy[(kind, prompt)] = reference_greedy(self.reference_model(kind), PROMPTS[prompt], NEW_TOKENS)
        return self._greedy[(kind, prompt)]


def _class_of(rank: int) -> int:
    return next(capacity for capacity in (8, 16, 64) if capacity >= rank)


@pytest.fixture(scope="module", params=["one-class", "rank-classes"])
def setup(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Setup]:
    base_dir = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=3)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        kind: build_adapter(base_dir, root / kind, seed=10 + i, **config)
        for i, (kind, config) in enumerate(ADAPTER_KINDS.items())
    }
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    slot_ranks = [_class_of(ADAPTER_KINDS[kind]["r"]) for kind in adapters] if request.param == "rank-classes" else []
    engine.warmup(256, 128, 16, max_active_adapters=len(adapters), max_lora_rank=64, slot_ranks=slot_ranks)
    assert engine.lora.slots is not None and len(engine.lora.slots.classes) == (3 if slot_ranks else 1)
    for slot, (kind, path) in enumerate(adapters.items()):
        info = engine.lora.load(kind, "local", str(path))
        assert info.rank == ADAPTER_KINDS[kind]["r"]
        engine.activate_adapter(kind, slot)
    yield Setup(base_dir, adapters, engine)



def _collect(outputs: dict[int, list[int]], step: StepResult) -> None:
    for generation in step.generations:
        outputs.setdefault(generation.request_id, []).append(generation.token_id)


def test_adapter_info_matches_peft_config(setup: Setup) -> None:
    for kind, config in ADAPTER_KINDS.items():
        info = setup.engine.lora.registry.info(kind)
        assert info is not None
        expected = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
        assert info.scaling == pytest.approx(expected)
        wrapped = {
            name.rsplit(".", 1)[-1]
            for name, module in setup.reference_model(kind).named_modules()
            if hasattr(module, "lora_A")
        }
        assert set(info.target_modules) == wrapped, kind


@torch.inference_mode()
def test_prefill_and_decode_logits_equal_peft_in_one_mixed_batch(setup: Setup) -> None:
    """Every kind and the base model in one flat prefill (logits of every position), then decode
    steps reading the paged cache: each sequence gets the logits peft gives it alone."""
    engine = setup.engine
    kinds: list[str | None] = [None, *ADAPTER_KINDS, None]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 30))] for _ in kinds]
    slots = [-1 if k is None else engine.lora.slots.slot_of(k) for k in kinds]  # type: ignore[union-attr]
    lens = [len(p) for p in prompts]
    blocks_each = -(-(max(lens) + 4) // BLOCK_SIZE)
    cache = PagedKVCache(engine.kv_spec, blocks_each * len(kinds), engine.device)
    table = torch.arange(blocks_each * len(kinds)).view(len(kinds), blocks_each)

    assert engine.lora.ranks is not None
    batch = build_prefill(lens, table, BLOCK_SIZE, engine.device, slots, engine.lora.ranks)
    # Ask for every position's logits: the last layer then runs on every row.
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens)), lora_rows=batch.lora)
    logits = engine.model(torch.tensor([t for p in prompts for t in p]), batch, cache).split(lens)
    base_logits = setup.reference_model(None)(torch.tensor([prompts[1]])).logits[0]
    for kind, prompt, ours in zip(kinds, prompts, logits, strict=True):
        expected = setup.reference_model(kind)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0, msg=lambda m, k=kind: f"{k}: {m}")
    # The adapters matter: peft's logits with the first adapter are far from the base's.
    adapted = setup.reference_model(kinds[1])(torch.tensor([prompts[1]])).logits[0]
    assert float((adapted - base_logits).abs().max()) > 0.5

    sequences = [list(p) for p in prompts]
    decode_lora = build_lora_meta(slots, [1] * len(slots), engine.lora.ranks, engine.device)
    for step in range(3):
        fed = [(17 * step + 5 * i + 3) % 300 for i in range(len(kinds))]
        batch = build_decode([len(s) for s in sequences], table, BLOCK_SIZE, engine.device, decode_lora)
        logits = engine.model(torch.tensor(fed), batch, cache)
        for i, (kind, token) in enumerate(zip(kinds, fed, strict=True)):
            sequences[i].append(token)
            expected = setup.reference_model(kind)(torch.tensor([sequences[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0, msg=lambda m, k=kind: f"{k}: {m}")


@pytest.mark.parametrize("kind", list(ADAPTER_KINDS))
def test_greedy_alone_equals_peft(setup: Setup, kind: str) -> None:
    engine, prompt = setup.engine, PROMPTS["long"]  # its KV spans three blocks
    outputs: dict[int, list[int]] = {}
    request = RequestSpec(
        id=1, input_ids=prompt, blocks=Blocks().table(len(prompt) + NEW_TOKENS), max_new_tokens=NEW_TOKENS,
        adapter_id=kind,
    )
    _collect(outputs, engine.prefill(1, [request]))
    for _ in range(NEW_TOKENS - 1):
        _collect(outputs, engine.decode([1]))
    engine.clear_cache(1)
    assert_greedy_matches(outputs[1], setup.greedy(kind, "long"), kind)


def test_six_adapters_and_base_in_one_batch_equal_peft(setup: Setup) -> None:
    """One prefill mixing six adapters (two neighbours share one) and the base; decoding in
    one batch; a request filtered out midway, another batch merged in."""
    engine, blocks = setup.engine, Blocks()
    plan: list[tuple[str | None, str]] = [
        (None, "short"), ("rank4", "long"), ("rank4", "short"), ("qv-only", "tiny"), (None, "long"),
        ("rank64", "short"), ("mlp-only", "long"), ("rslora", "tiny"), ("rank16", "long"),
    ]
    requests = [
        RequestSpec(
            id=rid, input_ids=PROMPTS[prompt], blocks=blocks.table(len(PROMPTS[prompt]) + NEW_TOKENS),
            max_new_tokens=NEW_TOKENS, adapter_id=kind or "",
        )
        for rid, (kind, prompt) in enumerate(plan)
    ]
    late = RequestSpec(
        id=100, input_ids=PROMPTS["long"], blocks=blocks.table(len(PROMPTS["long"]) + NEW_TOKENS),
        max_new_tokens=NEW_TOKENS, adapter_id="every-linear",
    )
    outputs: dict[int, list[int]] = {}
    _collect(outputs, engine.prefill(1, requests))
    _collect(outputs, engine.prefill(2, [late]))
    dropped = 5
    for step in range(NEW_TOKENS - 1):
        if step == 4:
            engine.filter_batch(1, [r.id for r in [*requests, late] if r.id != dropped])
        _collect(outputs, engine.decode([1, 2] if step == 0 else [1]))
    engine.clear_cache()
    assert len(outputs[dropped]) == 5
    for rid, (kind, prompt) in enumerate(plan):
        got, ref = outputs[rid], setup.greedy(kind, prompt)
        ref = Reference(ref.tokens[: len(got)], ref.logits[: len(got)])  # the dropped one is short
        assert_greedy_matches(got, ref, f"request {rid}: {kind} / {prompt}")
    assert_greedy_matches(outputs[100], setup.greedy("every-linear", "long"), "merged-in request")
