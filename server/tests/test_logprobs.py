"""Top logprobs and prompt logprobs against transformers/peft: log_softmax of the reference's
logits on the same weights, for prefill and decode, on the base model and through a LoRA adapter,
with the asking requests batched beside requests that ask for nothing (and stay unaffected)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from tiny_adapters import ALL_PROJECTIONS, build_adapter, peft_reference
from block_tables import Blocks
from tiny_models import build_tiny_model

from quiver_server.engine.batch_types import RequestSpec, SamplingParams, TokenLogprob, TokenOut
from quiver_server.engine.engine import Engine
from quiver_server.engine.forward_batch import build_prefill
from quiver_server.engine import logprobs
from quiver_server.engine.kv_cache import BLOCK_SIZE
from quiver_server.engine.logprobs import top_tokens

ATOL = 1e-4
ADAPTER = "tiny-lora"
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 300) for _ in range(n)] for n in (9, 23, 5, 17, 1)]


@dataclass
class Setup:
    engine: Engine
    models: dict[str, torch.nn.Module]  # "" (base) or ADAPTER -> the transformers/peft reference

    @torch.no_grad()
    def log_softmax(self, adapter: str, tokens: Sequence[int]) -> torch.Tensor:
        """[len(tokens), V]: the reference's log_softmax at every position of `tokens`."""
        return torch.log_softmax(self.models[adapter](torch.tensor([list(tokens)])).logits[0], dim=-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    base = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=21)
    adapter = build_adapter(base, tmp_path_factory.mktemp("adapter") / "a", seed=5, r=8, lora_alpha=16,
                            target_modules=ALL_PROJECTIONS)
    engine = Engine(str(base), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 8, max_active_adapters=1, max_lora_rank=8)
    engine.lora.load(ADAPTER, "local", str(adapter))
    engine.activate_adapter(ADAPTER, 0)
    return Setup(engine, {"": peft_reference(base, None), ADAPTER: peft_reference(base, adapter)})



def assert_top_matches(got: list[TokenLogprob], reference: torch.Tensor, k: int, what: str) -> None:
    """`got` is the reference's k most likely tokens, most likely first, each with the
    reference's logprob. Near-ties may come in either order, so membership is checked by value:
    no token left out is likelier (beyond ATOL) than the least likely one reported."""
    assert len(got) == k, what
    if k == 0:
        return
    ids = [t.token_id for t in got]
    assert len(set(ids)) == k, what
    for token in got:
        assert token.logprob == pytest.approx(reference[token.token_id].item(), abs=ATOL), what
    values = [t.logprob for t in got]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False)), what
    left_out = torch.ones_like(reference, dtype=torch.bool)
    left_out[ids] = False
    assert reference[left_out].max().item() <= min(values) + ATOL, what


def test_top_tokens_break_ties_by_lower_id() -> None:
    """Many exact ties (small integers): the order is (value descending, id ascending), as a
    plain Python sort of (-value, id) says, for every k."""
    logits = torch.randint(-3, 4, (6, 40), generator=torch.Generator().manual_seed(2)).float()
    logits[0, 5] = float("nan")  # ranks last, never reported ahead of a number
    for k in (1, 3, 7, 20, 40):
        ids, values = top_tokens(logits, k)
        for row in range(logits.shape[0]):
            finite = logits[row].nan_to_num(nan=float("-inf")).tolist()
            expected = sorted(range(40), key=lambda i, r=finite: (-r[i], i))[:k]
            assert ids[row].tolist() == expected, (row, k)
            assert values[row].tolist() == [finite[i] for i in expected]


def test_top_tokens_order_ties_inside_the_cut_by_lower_id() -> None:
    """Distinct values at every cut, equal ones among the kept (the one-topk path, which the
    many boundary ties above send to the exact one): still (value descending, id ascending)."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.stack([torch.randperm(50, generator=generator).float() for _ in range(4)])
    for row in range(4):  # the two largest of each row become equal, the third joins in row 2
        order = logits[row].argsort(descending=True)
        logits[row, order[1]] = logits[row, order[0]]
        if row == 2:
            logits[row, order[2]] = logits[row, order[0]]
    for k in (3, 4, 10, 50):
        ids, values = top_tokens(logits, k)
        for row in range(4):
            scores = logits[row].tolist()
            expected = sorted(range(50), key=lambda i, r=scores: (-r[i], i))[:k]
            assert ids[row].tolist() == expected, (row, k)
            assert values[row].tolist() == [scores[i] for i in expected]


def _collect(outputs: dict[int, list[TokenOut]], generations: list[TokenOut]) -> None:
    for generation in generations:
        outputs.setdefault(generation.request_id, []).append(generation)


def test_top_logprobs_equal_reference_in_prefill_and_decode(setup: Setup) -> None:
    """Greedy and sampled rows asking 1..20 alternatives on the base and the adapter, beside a
    greedy base request and a greedy adapter request that ask nothing."""
    steps, blocks = 4, Blocks()
    plan = [  # (adapter, prompt, params)
        ("", 0, SamplingParams(top_logprobs=5)),
        (ADAPTER, 1, SamplingParams(top_logprobs=20)),
        ("", 2, SamplingParams()),
        (ADAPTER, 3, SamplingParams(temperature=1.0, seed=3, top_logprobs=2)),
        (ADAPTER, 0, SamplingParams()),
        ("", 4, SamplingParams(temperature=0.7, seed=8, top_k=10, top_logprobs=1)),
    ]
    requests = [
        RequestSpec(id=i, input_ids=PROMPTS[p], blocks=blocks.table(len(PROMPTS[p]) + steps),
                    sampling=params, max_new_tokens=steps, adapter_id=adapter)
        for i, (adapter, p, params) in enumerate(plan)
    ]
    outputs: dict[int, list[TokenOut]] = {}
    _collect(outputs, setup.engine.prefill(1, requests).generations)
    for _ in range(steps - 1):
        _collect(outputs, setup.engine.decode([1]).generations)
    setup.engine.clear_cache(1)
    for rid, (adapter, p, params) in enumerate(plan):
        tokens = [g.token_id for g in outputs[rid]]
        reference = setup.log_softmax(adapter, PROMPTS[p] + tokens)[len(PROMPTS[p]) - 1 :]
        for step, generation in enumerate(outputs[rid]):
            what = f"request {rid} step {step}"
            assert generation.logprob == pytest.approx(reference[step, generation.token_id].item(), abs=ATOL), what
            if params.temperature == 0:  # ask nothing or not, greedy stays the reference's argmax
                assert generation.token_id == int(reference[step].argmax()), what
            if params.top_logprobs:
                assert_top_matches(generation.top_logprobs, reference[step], params.top_logprobs, what)
            else:
                assert generation.top_logprobs == [], what
            assert generation.prompt_logprobs == [], what


def test_prompt_logprobs_equal_reference_beside_a_normal_request(setup: Setup) -> None:
    """prompt_logprobs on the base and the adapter (with and without alternatives, one-token
    prompt included) in one prefill with plain requests; then a decode step of the whole batch."""
    blocks = Blocks()
    plan = [  # (adapter, prompt, prompt_logprobs, params)
        ("", 1, 3, SamplingParams()),
        ("", 0, None, SamplingParams()),
        (ADAPTER, 3, 0, SamplingParams(top_logprobs=4)),
        (ADAPTER, 2, None, SamplingParams()),
        (ADAPTER, 0, 20, SamplingParams()),
        ("", 4, 2, SamplingParams()),
    ]
    requests = [
        RequestSpec(id=i, input_ids=PROMPTS[p], blocks=blocks.table(len(PROMPTS[p]) + 2), sampling=params,
                    max_new_tokens=2, adapter_id=adapter, prompt_logprobs=asked)
        for i, (adapter, p, asked, params) in enumerate(plan)
    ]
    outputs: dict[int, list[TokenOut]] = {}
    _collect(outputs, setup.engine.prefill(2, requests).generations)
    _collect(outputs, setup.engine.decode([2]).generations)
    setup.engine.clear_cache(2)
    for rid, (adapter, p, asked, params) in enumerate(plan):
        prompt, (first, second) = PROMPTS[p], outputs[rid]
        reference = setup.log_softmax(adapter, prompt + [first.token_id])
        # The sampled tokens come from the last prompt row, then from the decode step.
        for position, generation in ((len(prompt) - 1, first), (len(prompt), second)):
            assert generation.token_id == int(reference[position].argmax()), f"request {rid}"
            assert generation.logprob == pytest.approx(reference[position, generation.token_id].item(), abs=ATOL)
        if params.top_logprobs:
            assert_top_matches(first.top_logprobs, reference[len(prompt) - 1], params.top_logprobs, f"{rid}")
        assert second.prompt_logprobs == []
        if asked is None:
            assert first.prompt_logprobs == [], f"request {rid}"
            continue
        assert len(first.prompt_logprobs) == len(prompt) - 1, f"request {rid}"
        for i, position in enumerate(first.prompt_logprobs, start=1):
            what = f"request {rid} prompt position {i}"
            assert position.logprob == pytest.approx(reference[i - 1, prompt[i]].item(), abs=ATOL), what
            assert_top_matches(position.top, reference[i - 1], asked, what)
            # Rank: 1 + the tokens strictly more likely; a token within ATOL of the prompt
            # token's logprob may fall on either side.
            row, target = reference[i - 1], reference[i - 1, prompt[i]]
            surely_above = int((row > target + ATOL).sum())
            maybe_above = int((row > target - ATOL).sum()) - 1  # minus the prompt token itself
            assert 1 + surely_above <= position.rank <= 1 + maybe_above, what


def test_prompt_logprobs_of_a_long_prompt_across_blocks(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt spanning several KV blocks, alone, on the adapter (every row through the LoRA
    kernels of the last layer), its positions read in chunks of 7 rows (the last one partial)."""
    monkeypatch.setattr(logprobs, "PROMPT_CHUNK_ROWS", 7)
    prompt = [(7 * i + 3) % 300 for i in range(3 * BLOCK_SIZE + 5)]
    request = RequestSpec(id=1, input_ids=prompt, blocks=Blocks().table(len(prompt) + 1), max_new_tokens=1,
                          adapter_id=ADAPTER, prompt_logprobs=1)
    generation = setup.engine.prefill(3, [request]).generations[0]
    setup.engine.clear_cache(3)
    reference = setup.log_softmax(ADAPTER, prompt)
    got = torch.tensor([p.logprob for p in generation.prompt_logprobs])
    expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert [p.top[0].token_id for p in generation.prompt_logprobs] == reference[:-1].argmax(dim=-1).tolist()
    assert generation.token_id == int(reference[-1].argmax())


def test_prefill_layout_gives_every_row_only_to_the_requests_that_ask() -> None:
    """Prompts of 3, 4, 2 and 1 tokens; the second and fourth ask for every row: they get theirs,
    the others their last, and each sequence's sampling row is its last one among them."""
    table = torch.arange(4)[:, None]
    batch = build_prefill([3, 4, 2, 1], table, BLOCK_SIZE, torch.device("cpu"), [0, -1, 0, 0], 8,
                          all_logits=[False, True, False, True])
    assert batch.logits_indices.tolist() == [2, 3, 4, 5, 6, 8, 9]
    assert batch.sample_rows is not None and batch.sample_rows.tolist() == [0, 4, 5, 6]
    # The last layer's LoRA rows follow the same selection: slot 0, then 4 base rows, then slot 0.
    assert batch.lora_rows is not None
    assert batch.lora_rows.token_slots.tolist() == [0, -1, -1, -1, -1, 0, 0]
    plain = build_prefill([3, 4, 2, 1], table, BLOCK_SIZE, torch.device("cpu"))
    assert plain.logits_indices.tolist() == [2, 6, 8, 9] and plain.sample_rows is None
