"""Prefix caching and chunked prefill against transformers and peft.

A prompt's leading K/V may already be in its blocks: a prefix another request wrote
(`cached_tokens`, as the router's prefix cache hands it out), or the earlier chunks of the same
prompt (`prefill_until`). Either way the first token, its logprob and the greedy continuation
must be those of one uncached prefill, and those are the reference's own (transformers' full
forward, peft's with an adapter): for the base model and adapters, with sliding windows whose
span crosses a chunk boundary, and in mixed batches where one request reads a prefix that
another request of the same call writes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch
from block_tables import Blocks
from tiny_adapters import ADAPTER_KINDS, Reference, References, assert_greedy_matches, build_adapter
from tiny_models import build_tiny_model
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from quiver_server.engine.batch_types import RequestSpec, SamplingParams, StepResult
from quiver_server.engine.engine import Engine
from quiver_server.engine.kv_cache import BLOCK_SIZE

ATOL = 1e-4
NEW_TOKENS = 8
ADAPTERS = ("rank4", "rank8-attention")
# case id -> (architecture, build_tiny_model keyword arguments). A window of 6 makes every chunk
# boundary below fall inside some query's window.
CASES = {
    "llama": ("llama", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen2-sliding-window-layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                             "max_window_layers": 1}),
}
_rng = random.Random(16)
PROMPTS = {name: [_rng.randrange(3, 300) for _ in range(n)] for name, n in (("a", 40), ("b", 37), ("c", 11))}
# The prompt "a" with another ending after its first two blocks (a shared system prompt).
PROMPTS["a-other-end"] = PROMPTS["a"][: 2 * BLOCK_SIZE] + [_rng.randrange(3, 300) for _ in range(9)]
CHUNK_ENDS = (7, 19, 30)  # "a" in four passes; none on a block boundary


@dataclasses.dataclass
class Setup(References):
    engine: Engine
    blocks: Blocks

    def request(self, rid: int, prompt: str, kind: str | None = None, **kwargs: object) -> RequestSpec:
        """A request on fresh blocks (or on `blocks` given in kwargs)."""
        ids = PROMPTS[prompt]
        kwargs.setdefault("blocks", self.blocks.table(len(ids) + NEW_TOKENS))
        return RequestSpec(id=rid, input_ids=ids, max_new_tokens=NEW_TOKENS, adapter_id=kind or "",
                           **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    arch, kwargs = CASES[request.param]
    seed = 20 + list(CASES).index(request.param)
    base_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=seed, **kwargs)
    root = tmp_path_factory.mktemp("adapters")
    adapters = {kind: build_adapter(base_dir, root / kind, seed=30 + i, **ADAPTER_KINDS[kind])
                for i, kind in enumerate(ADAPTERS)}
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 16, max_active_adapters=len(adapters), max_lora_rank=16)
    for slot, (kind, path) in enumerate(adapters.items()):
        engine.lora.load(kind, "local", str(path))
        engine.activate_adapter(kind, slot)
    yield Setup(base_dir, adapters, PROMPTS, NEW_TOKENS, engine, Blocks())
    engine.clear_cache()


def _tokens(step: StepResult) -> dict[int, tuple[int, float]]:
    return {g.request_id: (g.token_id, g.logprob) for g in step.generations}


def _decode_rest(engine: Engine, batch_ids: list[int], outputs: dict[int, list[int]]) -> None:
    """Decodes the merged batches until every request has NEW_TOKENS tokens, then drops them."""
    for _ in range(NEW_TOKENS - 1):
        for generation in engine.decode(batch_ids).generations:
            outputs[generation.request_id].append(generation.token_id)
        batch_ids = batch_ids[:1]
    engine.clear_cache(batch_ids[0])


def _assert_first_token(got: tuple[int, float], reference: Reference, what: str) -> None:
    """The first token is the reference's argmax, with the reference's raw logprob."""
    token, logprob = got
    assert token == reference.tokens[0], what
    expected = float(torch.log_softmax(reference.logits[0], dim=-1)[token])
    assert logprob == pytest.approx(expected, abs=ATOL), what


@pytest.mark.parametrize("kind", [None, "rank4"])
def test_cached_prefix_equals_uncached_prefill_and_reference(setup: Setup, kind: str | None) -> None:
    """A request that wrote the prompt's first two blocks ends; the full prompt then comes with
    those blocks and cached_tokens = 32, beside an uncached prefill of the same prompt."""
    engine, prefix = setup.engine, 2 * BLOCK_SIZE
    writer = RequestSpec(id=1, input_ids=PROMPTS["a"][:prefix], blocks=setup.blocks.table(prefix + 1),
                         max_new_tokens=1, adapter_id=kind or "")
    engine.prefill(1, [writer])
    engine.clear_cache(1)  # the request finished; its blocks stay in the (router's) prefix cache
    cached = setup.request(2, "a", kind, cached_tokens=prefix,
                           blocks=writer.blocks[:2] + setup.blocks.table(len(PROMPTS["a"]) + NEW_TOKENS - prefix))
    uncached = setup.request(3, "a", kind)
    first = {**_tokens(engine.prefill(2, [cached])), **_tokens(engine.prefill(3, [uncached]))}
    reference = setup.reference(kind, "a")
    _assert_first_token(first[2], reference, "cached prefix")
    _assert_first_token(first[3], reference, "uncached")
    assert first[2][1] == pytest.approx(first[3][1], abs=ATOL)

    outputs = {rid: [token] for rid, (token, _) in first.items()}
    _decode_rest(engine, [2, 3], outputs)
    assert outputs[2] == outputs[3]
    assert_greedy_matches(outputs[2], reference, f"cached prefix, {kind or 'base'}")


@pytest.mark.parametrize("kind", [None, "rank8-attention"])
def test_chunked_prefill_equals_unchunked_and_reference(setup: Setup, kind: str | None) -> None:
    """The prompt in three chunks (boundaries inside blocks and inside the sliding window), then
    its last chunk: the chunks sample nothing and keep no batch; the last one gives the tokens
    of one unchunked prefill."""
    engine = setup.engine
    blocks = setup.blocks.table(len(PROMPTS["a"]) + NEW_TOKENS)
    begin = 0
    for batch_id, end in enumerate(CHUNK_ENDS, start=10):
        step = engine.prefill(batch_id, [setup.request(4, "a", kind, blocks=blocks, cached_tokens=begin,
                                                       prefill_until=end)])
        assert (step.generations, step.batch_id, step.request_ids) == ([], batch_id, [])
        assert batch_id not in engine.batches
        begin = end
    last = engine.prefill(13, [setup.request(4, "a", kind, blocks=blocks, cached_tokens=begin)])
    assert last.request_ids == [4]
    whole = engine.prefill(14, [setup.request(5, "a", kind)])
    first = {**_tokens(last), **_tokens(whole)}
    reference = setup.reference(kind, "a")
    _assert_first_token(first[4], reference, "chunked")
    assert first[4][1] == pytest.approx(first[5][1], abs=ATOL)

    outputs = {rid: [token] for rid, (token, _) in first.items()}
    _decode_rest(engine, [13, 14], outputs)
    assert outputs[4] == outputs[5]
    assert_greedy_matches(outputs[4], reference, f"chunked, {kind or 'base'}")


def test_mixed_batch_with_a_prefix_written_in_the_same_call(setup: Setup) -> None:
    """One prefill mixing: a request writing a prefix (adapter rank4) and one reading it in the
    same call (same adapter); a chunk of a third prompt (another adapter) that finishes in a
    later prefill; a fresh base request asking prompt logprobs; a base request whose prefix an
    earlier, chunk-only prefill wrote. Only the finished ones are sampled and kept, in order."""
    engine, prefix = setup.engine, 2 * BLOCK_SIZE
    early = setup.request(25, "c", None, prefill_until=5)
    assert engine.prefill(20, [early]).request_ids == []
    writer = setup.request(21, "a", "rank4")
    reader = setup.request(22, "a-other-end", "rank4", cached_tokens=prefix,
                           blocks=writer.blocks[:2] + setup.blocks.table(9 + NEW_TOKENS))
    chunk_blocks = setup.blocks.table(len(PROMPTS["b"]) + NEW_TOKENS)
    chunk = setup.request(23, "b", "rank8-attention", blocks=chunk_blocks, prefill_until=20)
    asking = setup.request(24, "c", None, prompt_logprobs=2)
    resumed = setup.request(25, "c", None, blocks=early.blocks, cached_tokens=5)
    step = engine.prefill(21, [writer, reader, chunk, asking, resumed])
    assert step.request_ids == [21, 22, 24, 25]
    assert [g.request_id for g in step.generations] == [21, 22, 24, 25]
    finished = engine.prefill(22, [setup.request(23, "b", "rank8-attention", blocks=chunk_blocks,
                                                 cached_tokens=20)])
    first = {**_tokens(step), **_tokens(finished)}
    plan = {21: ("rank4", "a"), 22: ("rank4", "a-other-end"), 23: ("rank8-attention", "b"), 24: (None, "c"),
            25: (None, "c")}
    for rid, (kind, prompt) in plan.items():
        _assert_first_token(first[rid], setup.reference(kind, prompt), f"request {rid}")

    # The prompt logprobs of the request beside the chunk are the reference's.
    positions = next(g for g in step.generations if g.request_id == 24).prompt_logprobs
    ids = PROMPTS["c"]
    with torch.no_grad():
        reference = torch.log_softmax(setup.model(None)(torch.tensor([ids])).logits[0], dim=-1)
    assert [p.logprob for p in positions] == pytest.approx(
        [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))], abs=ATOL)

    outputs = {rid: [token] for rid, (token, _) in first.items()}
    _decode_rest(engine, [21, 22], outputs)
    for rid, (kind, prompt) in plan.items():
        assert_greedy_matches(outputs[rid], setup.reference(kind, prompt), f"request {rid}: {kind} / {prompt}")


def test_one_new_token_per_request_after_cached_prefixes(setup: Setup) -> None:
    """Every request computes a single token after its cached prefix (its LoRA metadata then
    looks like a decode step's): base and two adapters, each on its own written prefix."""
    engine, plan = setup.engine, {31: None, 32: "rank4", 33: "rank8-attention"}
    prompt = PROMPTS["b"]
    writers = [setup.request(rid, "b", kind, prefill_until=len(prompt) - 1) for rid, kind in plan.items()]
    assert engine.prefill(30, writers).request_ids == []
    readers = [setup.request(w.id, "b", w.adapter_id or None, blocks=w.blocks, cached_tokens=len(prompt) - 1)
               for w in writers]
    first = _tokens(engine.prefill(31, readers))
    engine.clear_cache(31)
    for rid, kind in plan.items():
        _assert_first_token(first[rid], setup.reference(kind, "b"), f"{kind or 'base'}")


def test_repetition_penalty_sees_the_whole_prompt(setup: Setup) -> None:
    """A prefix hit and a chunked prompt still penalise every prompt token, the cached ones too:
    greedy under transformers' own RepetitionPenaltyLogitsProcessor over prompt + output."""
    engine, prompt, penalty = setup.engine, PROMPTS["a"], 1.8
    sampling = SamplingParams(repetition_penalty=penalty)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    expected, sequence = [], list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = setup.model(None)(torch.tensor([sequence])).logits[:, -1]
            expected.append(int(processor(torch.tensor([sequence]), logits).argmax()))
            sequence.append(expected[-1])

    writer = setup.request(51, "a", prefill_until=BLOCK_SIZE)
    assert engine.prefill(50, [writer]).request_ids == []
    hit = setup.request(52, "a", sampling=sampling, cached_tokens=BLOCK_SIZE,
                        blocks=writer.blocks[:1] + setup.blocks.table(len(prompt) + NEW_TOKENS - BLOCK_SIZE))
    chunked = setup.request(51, "a", sampling=sampling, blocks=writer.blocks, cached_tokens=BLOCK_SIZE)
    outputs = {rid: [token] for rid, (token, _) in _tokens(engine.prefill(51, [hit, chunked])).items()}
    _decode_rest(engine, [51], outputs)
    assert outputs == {51: expected, 52: expected}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cached_tokens": 40}, "cached_tokens = 40 must be less than the prompt's 40 tokens"),
        ({"cached_tokens": 10, "prefill_until": 10}, "prefill_until = 10 must be above cached_tokens = 10"),
        ({"prefill_until": 41}, "prefill_until = 41 must be above cached_tokens = 0 and at most"),
        ({"cached_tokens": 16, "prompt_logprobs": 0}, "prompt_logprobs need the whole prompt"),
        ({"prefill_until": 20, "prompt_logprobs": 1}, "prompt_logprobs need the whole prompt"),
    ],
    ids=["cached-whole-prompt", "empty-chunk", "chunk-past-the-prompt", "logprobs-with-cache", "logprobs-in-chunk"],
)
def test_bad_spans_are_refused_and_the_engine_goes_on(setup: Setup, fields: dict, message: str) -> None:
    engine = setup.engine
    with pytest.raises(ValueError, match=message):
        engine.prefill(40, [setup.request(40, "a", None, **fields), setup.request(41, "c")])
    assert 40 not in engine.batches
    fine = engine.prefill(40, [setup.request(41, "c")])
    engine.clear_cache(40)
    _assert_first_token(_tokens(fine)[41], setup.reference(None, "c"), "after a refused prefill")
