"""Mixed steps against transformers and peft: a prefill run in the forward pass of a decode step.

While two requests decode (the base model and an adapter), each step carries new prompts: a
chunk of a prompt that a later step finishes, fresh prompts on the base and on adapters, one
asking for prompt logprobs, one with a cached prefix. Every request's first token, its logprob
and its greedy continuation must be the reference's own (a full forward pass of transformers,
or peft with the adapter, over the whole sequence at every step); the prefill's finished prompts
join the decoded batch and go on decoding there. Families: a dense model, one with a sliding
window that the chunk boundaries cross, and a mixture of experts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch
from block_tables import Blocks
from tiny_adapters import ADAPTER_KINDS, References, assert_greedy_matches, build_adapter
from tiny_models import build_tiny_model

from quiver_server.engine.batch_types import RequestSpec, StepResult
from quiver_server.engine.engine import Engine
from quiver_server.engine.kv_cache import BLOCK_SIZE

ATOL = 1e-4
NEW_TOKENS = 6
ADAPTERS = ("rank4", "rank8-attention")
CASES = {
    "llama": ("llama", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen3-moe": ("qwen3_moe", {}),
}
_rng = random.Random(50)
PROMPTS = {name: [_rng.randrange(3, 300) for _ in range(n)] for name, n in
           (("a", 23), ("b", 37), ("c", 11), ("d", 19), ("e", 3))}


@dataclasses.dataclass
class Setup(References):
    engine: Engine
    blocks: Blocks

    def request(self, rid: int, prompt: str, kind: str | None = None, **kwargs: object) -> RequestSpec:
        kwargs.setdefault("blocks", self.blocks.table(len(PROMPTS[prompt]) + NEW_TOKENS))
        kwargs.setdefault("max_new_tokens", NEW_TOKENS)
        return RequestSpec(id=rid, input_ids=PROMPTS[prompt], adapter_id=kind or "", **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    arch, kwargs = CASES[request.param]
    base_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=50, **kwargs)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {kind: build_adapter(base_dir, root / kind, seed=60 + i, **ADAPTER_KINDS[kind])
                for i, kind in enumerate(ADAPTERS)}
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 16, max_active_adapters=len(adapters), max_lora_rank=16)
    for slot, (kind, path) in enumerate(adapters.items()):
        engine.lora.load(kind, "local", str(path))
        engine.activate_adapter(kind, slot)
    yield Setup(base_dir, adapters, PROMPTS, NEW_TOKENS, engine, Blocks())
    engine.clear_cache()


def _record(outputs: dict[int, list[int]], firsts: dict[int, tuple[int, float]], step: StepResult,
            first: bool) -> None:
    for g in step.generations:
        outputs.setdefault(g.request_id, []).append(g.token_id)
        if first:
            firsts[g.request_id] = (g.token_id, g.logprob)


def test_prefills_mixed_into_decode_steps_serve_the_references_tokens(setup: Setup) -> None:
    engine, prefix = setup.engine, BLOCK_SIZE
    plan = {1: (None, "a"), 2: ("rank4", "b"), 3: ("rank8-attention", "c"), 4: (None, "d"), 5: ("rank4", "a"),
            6: (None, "e"), 7: ("rank4", "e")}
    outputs: dict[int, list[int]] = {}
    firsts: dict[int, tuple[int, float]] = {}
    _record(outputs, firsts, engine.prefill(1, [setup.request(1, "a"), setup.request(2, "b", "rank4")]), True)

    # Step 1: the decode of 1 and 2 carries the first chunk of 3's prompt (nothing sampled for it).
    chunk_blocks = setup.blocks.table(len(PROMPTS["c"]) + NEW_TOKENS)
    decoded, prefilled = engine.mixed_step([1], 2, [setup.request(3, "c", "rank8-attention", blocks=chunk_blocks,
                                                                  prefill_until=7)])
    assert (prefilled.generations, prefilled.request_ids, decoded.request_ids) == ([], [], [1, 2])
    assert 2 not in engine.batches
    _record(outputs, firsts, decoded, False)

    # Step 2: the rest of 3's prompt; 4 fresh, asking prompt logprobs; 5 fresh on an adapter.
    decoded, prefilled = engine.mixed_step([1], 3, [
        setup.request(3, "c", "rank8-attention", blocks=chunk_blocks, cached_tokens=7),
        setup.request(4, "d", prompt_logprobs=1),
        setup.request(5, "a", "rank4"),
    ])
    assert prefilled.request_ids == [3, 4, 5]
    assert decoded.request_ids == [1, 2, 3, 4, 5]
    _record(outputs, firsts, decoded, False)
    _record(outputs, firsts, prefilled, True)
    ids = PROMPTS["d"]
    positions = next(g for g in prefilled.generations if g.request_id == 4).prompt_logprobs
    with torch.no_grad():
        reference = torch.log_softmax(setup.model(None)(torch.tensor([ids])).logits[0], dim=-1)
    assert [p.logprob for p in positions] == pytest.approx(
        [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))], abs=ATOL)

    # Step 3: two one-token-short prompts, base and adapter, beside five decoding rows; then a
    # cached-prefix prompt reading the block request 1 wrote.
    decoded, prefilled = engine.mixed_step([1], 4, [setup.request(6, "e"), setup.request(7, "e", "rank4")])
    assert prefilled.request_ids == [6, 7]
    _record(outputs, firsts, decoded, False)
    _record(outputs, firsts, prefilled, True)
    plan[8] = (None, "a")
    tail_blocks = setup.blocks.table(len(PROMPTS["a"]) + NEW_TOKENS - prefix)
    shared = setup.request(8, "a", cached_tokens=prefix, blocks=[_blocks_of(engine, 1)[0]] + tail_blocks)
    decoded, prefilled = engine.mixed_step([1], 5, [shared])
    _record(outputs, firsts, decoded, False)
    _record(outputs, firsts, prefilled, True)

    for rid, (kind, prompt) in plan.items():
        reference_run = setup.reference(kind, prompt)
        if rid in firsts:
            token, logprob = firsts[rid]
            assert token == reference_run.tokens[0], f"request {rid}"
            expected = float(torch.log_softmax(reference_run.logits[0], dim=-1)[token])
            assert logprob == pytest.approx(expected, abs=ATOL), f"request {rid}"
    while any(len(outputs[rid]) < NEW_TOKENS for rid in plan):
        for g in engine.decode([1]).generations:
            outputs[g.request_id].append(g.token_id)
        done = [rid for rid in engine.batches[1].request_ids if len(outputs[rid]) >= NEW_TOKENS]
        if done:
            engine.filter_batch(1, [rid for rid in engine.batches[1].request_ids if rid not in done])
            if 1 not in engine.batches:
                break
    for rid, (kind, prompt) in plan.items():
        assert_greedy_matches(outputs[rid][:NEW_TOKENS], setup.reference(kind, prompt),
                              f"request {rid}: {kind or 'base'} / {prompt}")
    engine.clear_cache()


def _blocks_of(engine: Engine, rid: int) -> list[int]:
    return next(r.blocks for batch in engine.batches.values() for r in batch.requests if r.id == rid)


def test_a_mixed_step_with_a_used_batch_id_is_refused_and_the_engine_goes_on(setup: Setup) -> None:
    engine = setup.engine
    engine.prefill(40, [setup.request(40, "c")])
    with pytest.raises(ValueError, match="already in use"):
        engine.mixed_step([40], 40, [setup.request(41, "e")])
    bad = dataclasses.replace(setup.request(41, "e"), input_ids=[3, 10**6])
    with pytest.raises(ValueError, match="out of range"):
        engine.mixed_step([40], 41, [setup.request(42, "e"), bad])
    assert engine.batches[40].request_ids == [40] and engine.batches[40].requests[0].length == len(PROMPTS["c"])
    decoded, prefilled = engine.mixed_step([40], 41, [setup.request(41, "e")])
    assert (decoded.request_ids, prefilled.request_ids) == ([40, 41], [41])
    assert list(engine.batches) == [40]
    engine.clear_cache()


def test_an_embedding_request_in_a_mixed_step_gets_its_own_pass(setup: Setup) -> None:
    """An `embed` request carried by a decode step is answered as a Prefill answers it (its
    pooled vector; embeddings' own parity with transformers is test_embeddings'), joins no batch,
    and the decoding row goes on."""
    engine = setup.engine
    engine.prefill(50, [setup.request(50, "c")])
    alone = engine.prefill(51, [setup.request(51, "d", embed=True, max_new_tokens=0)]).generations[0].embedding
    carried = [setup.request(52, "d", embed=True, max_new_tokens=0), setup.request(53, "e")]
    decoded, prefilled = engine.mixed_step([50], 52, carried)
    assert [g.request_id for g in decoded.generations] == [50]
    assert [g.request_id for g in prefilled.generations] == [53, 52]
    assert decoded.request_ids == [50, 53] and prefilled.request_ids == [53]
    embedded = next(g for g in prefilled.generations if g.request_id == 52).embedding
    assert embedded is not None and alone is not None
    torch.testing.assert_close(torch.tensor(embedded), torch.tensor(alone), atol=1e-5, rtol=0)
    engine.clear_cache()
