"""Per-request sampling inside one batch: filters against transformers' logits processors,
seeded reproducibility independent of the batch, and greedy with repetition penalty against
transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import build_tiny_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from quiver_server.engine.batch_types import RequestSpec, SamplingParams
from quiver_server.engine.engine import Engine
from quiver_server.engine.draw_streams import as_int64, uniforms
from quiver_server.engine.sampling import SamplingBatch, apply_repetition_penalty, sample, warp_scores

CPU = torch.device("cpu")
ROW_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=1),
]


def _transformers_warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The warper chain transformers' generate builds for these parameters, in its order."""
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return scores


def test_filters_match_transformers_row_by_row() -> None:
    logits = torch.randn(len(ROW_PARAMS), 300, generator=torch.Generator().manual_seed(0)) * 3
    ours = warp_scores(logits, SamplingBatch.from_params(ROW_PARAMS, CPU))
    for row, params in enumerate(ROW_PARAMS):
        expected = _transformers_warp(logits[row : row + 1], params)[0]
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(expected)), params
        kept = torch.isfinite(expected)
        torch.testing.assert_close(ours[row][kept], expected[kept])


def test_repetition_penalty_matches_transformers() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=generator)
    history = torch.randint(0, 50, (3, 12), generator=generator)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, history, True)
    for penalty in (0.7, 1.0, 1.8):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
        ours = apply_repetition_penalty(logits, seen, torch.full((3, 1), penalty))
        torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_draws_follow_the_filtered_distribution() -> None:
    """4000 rows with their own seeds: empirical frequencies match softmax, and top_k=2 keeps
    the two likeliest tokens renormalised."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 4000
    logits = probs.log().expand(rows, 4)
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0, seed=seed) for seed in range(rows)], CPU)
    tokens, logprobs, _ = sample(logits, batch)
    frequencies = torch.bincount(tokens, minlength=4) / rows
    torch.testing.assert_close(frequencies, probs, atol=0.03, rtol=0)
    torch.testing.assert_close(logprobs, probs.log()[tokens])
    top2 = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=2, seed=seed) for seed in range(rows)],
                                     CPU)
    tokens, _, _ = sample(logits, top2)
    frequencies = torch.bincount(tokens, minlength=4) / rows
    torch.testing.assert_close(frequencies, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]), atol=0.03, rtol=0)


def test_a_resumed_stream_continues_the_same_draws() -> None:
    """A preempted request resumes with `draws_done` = the tokens it had: its stream's next draw
    is the one the uninterrupted request would have made, whatever shares its batch."""
    rows, steps, stop = 64, 12, 5
    logits = torch.randn(steps, rows, 50, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(rows)], CPU)
    draws = torch.zeros(rows, dtype=torch.long)
    expected = []
    for step in range(steps):
        expected.append(sample(logits[step], batch, draws)[0])
        draws += batch.draws_per_step
    # Rows 0..31 alone, then resumed at draw `stop` beside other rows.
    half = SamplingBatch.from_params([SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(32)], CPU)
    resumed = torch.full((32,), stop, dtype=torch.long)
    for step in range(stop, steps):
        got = sample(logits[step, :32], half, resumed)[0]
        resumed += half.draws_per_step
        torch.testing.assert_close(got, expected[step][:32], rtol=0, atol=0)


def _splitmix64(seed: int, draw: int) -> float:
    """SplitMix64's draw-th output (0-based) for `seed`, in plain Python integers."""
    mask = (1 << 64) - 1
    z = (seed + (draw + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) / 2.0**53


def test_draw_streams_are_splitmix64() -> None:
    """The vectorised int64 stream (wrapping products, masked shifts) against SplitMix64 in
    Python integers, seeds across the whole uint64 range."""
    seeds = [0, 1, 42, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    draws = [0, 1, 7, 1000, 2**40]
    pairs = [(s, d) for s in seeds for d in draws]
    got = uniforms(torch.tensor([as_int64(s) for s, _ in pairs]), torch.tensor([d for _, d in pairs]))
    assert got.dtype == torch.float64 and bool(((got >= 0) & (got < 1)).all())
    assert got.tolist() == [_splitmix64(s, d) for s, d in pairs]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sampling"), "qwen2", seed=3)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    engine = Engine(str(model_path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 8)
    return engine


NEW_TOKENS = 10
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [99]]


def _generate(engine: Engine, prompts_and_params: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Runs the requests as one batch for NEW_TOKENS tokens; returns each one's tokens."""
    requests = [
        RequestSpec(id=i, input_ids=prompt, blocks=[2 * i, 2 * i + 1], sampling=params, max_new_tokens=NEW_TOKENS)
        for i, (prompt, params) in enumerate(prompts_and_params)
    ]
    outputs: list[list[int]] = [[] for _ in requests]
    result = engine.prefill(0, requests)
    for _ in range(NEW_TOKENS):
        for generation in result.generations:
            outputs[generation.request_id].append(generation.token_id)
        if len(outputs[0]) == NEW_TOKENS:
            break
        result = engine.decode([0])
    engine.clear_cache(0)
    return outputs


def test_seeds_reproduce_and_differ(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    first = _generate(engine, [(PROMPTS[0], params)])
    assert _generate(engine, [(PROMPTS[0], params)]) == first
    other_seeds = [_generate(engine, [(PROMPTS[0], SamplingParams(temperature=1.0, seed=s))])[0] for s in (1, 2, 3)]
    assert all(tokens != first[0] for tokens in other_seeds)


def test_top_k_one_is_greedy(engine: Engine) -> None:
    greedy = _generate(engine, [(p, SamplingParams()) for p in PROMPTS])
    top1 = _generate(engine, [(p, SamplingParams(temperature=1.5, top_k=1, seed=9)) for p in PROMPTS])
    assert top1 == greedy


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(engine: Engine) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    alone = _generate(engine, [(PROMPTS[1], seeded)])[0]
    batched = _generate(
        engine,
        [
            (PROMPTS[0], SamplingParams()),
            (PROMPTS[1], seeded),
            (PROMPTS[2], SamplingParams(temperature=1.2, top_k=10, min_p=0.1, repetition_penalty=1.3, seed=5)),
        ],
    )
    assert batched[1] == alone


@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_greedy_with_repetition_penalty_equals_transformers(engine: Engine, model_path: Path, penalty: float) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=penalty,
            eos_token_id=None, pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    # Mixed with a penalty-free request: rows without a penalty must be left alone.
    ours = _generate(engine, [(p, SamplingParams(repetition_penalty=penalty)) for p in PROMPTS]
                     + [(PROMPTS[0], SamplingParams())])
    assert ours[:3] == expected
    assert ours[3] == _generate(engine, [(PROMPTS[0], SamplingParams())])[0]


# ---- greedy rows on the fused CPU kernel ----------------------------------------------------


def _torch_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: torch.argmax on the float32 logits, and log_softmax at that token in float64."""
    tokens = logits.argmax(dim=-1)
    exact = logits.double()
    return tokens, (exact.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(exact, dim=-1)).float()


FLOAT32_UNIT_ROUNDOFF = 2.0**-24
# The greedy kernel sums exp(l - max) in blocks of this many float32 terms (greedy.cpp, kSumBlock)
# whose totals add up in float64, so no chain of float32 roundings is longer than this.
GREEDY_SUM_CHAIN = 128


def _greedy_logprob_error_bound(logits: torch.Tensor, tokens: torch.Tensor, chain: int) -> torch.Tensor:
    """Per row, a bound on |logprob - exact| for a float32 computation of logits[token] - max -
    log(sum_v exp(logits[v] - max)) whose sum has float32 rounding chains of at most `chain` terms:
    - the sum: relative error <= chain * u (u = 2^-24) for non-negative terms;
    - each term: exp within 2 ulp (4u relative), and the rounded difference d = l - max costs a
      relative u * |d| of that term, i.e. u * E[|d|] under the softmax weights in all;
    - log(sum) turns the sum's relative error into an absolute one of the same size, and the final
      rounding to float32 adds half an ulp of |logprob| (<= u * |logprob|).
    The 1.01 covers the second-order terms these first-order bounds leave out."""
    exact = logits.double()
    distance = exact.max(dim=-1, keepdim=True).values - exact
    weights = torch.softmax(exact, dim=-1)
    mean_distance = (weights * distance.nan_to_num(posinf=0.0)).sum(dim=-1)
    logprob = exact.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(exact, dim=-1)
    return 1.01 * FLOAT32_UNIT_ROUNDOFF * (chain + 4 + mean_distance + logprob.abs())


@pytest.mark.cpu_kernels
def test_greedy_kernel_matches_argmax_and_log_softmax() -> None:
    from quiver_server.kernels import cpu_ops

    assert cpu_ops.available()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 32003, generator=gen) * 6  # a vocabulary not a multiple of any vector width
    logits[1, 17] = logits[1, 20000] = logits[1].max() + 1.0  # a tie: the first index wins
    logits[2, :] = -7.0  # all equal
    logits[3, ::3] = float("-inf")  # masked tokens
    logits[4, -1] = logits[4].max() + 2.0  # the maximum in the tail after the last full vector
    logits[5] *= 30  # a peaked row: most terms far below the maximum
    tokens, logprobs = cpu_ops.greedy_logprob(logits)
    expected_tokens, expected_logprobs = _torch_greedy(logits)
    assert torch.equal(tokens, expected_tokens) and tokens[1] == 17 and tokens[4] == 32002
    error = (logprobs.double() - expected_logprobs.double()).abs()
    bound = _greedy_logprob_error_bound(logits, tokens, GREEDY_SUM_CHAIN)
    assert (error <= bound).all(), (error, bound)


@pytest.mark.cpu_kernels
def test_greedy_kernel_non_finite_rows_match_torch() -> None:
    from quiver_server.kernels import cpu_ops

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    logits[0, 40] = float("nan")  # torch.argmax picks the NaN
    logits[1, :] = float("-inf")
    logits[2, 7] = float("inf")
    logits[3, 50] = float("nan")
    logits[3, 60] = float("inf")
    tokens, logprobs = cpu_ops.greedy_logprob(logits)
    expected_tokens, expected_logprobs = _torch_greedy(logits)
    assert torch.equal(tokens, expected_tokens), (tokens, expected_tokens)
    assert torch.isnan(logprobs).all() and torch.isnan(expected_logprobs).all()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops.greedy_logprob(logits.double())


@pytest.mark.cpu_kernels
def test_all_greedy_batch_takes_the_kernel_and_agrees_with_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(5)) * 4
    params = SamplingBatch.from_params([SamplingParams()] * 5, CPU)
    from quiver_server.kernels import cpu_ops

    calls = []
    kernel = cpu_ops.greedy_logprob
    monkeypatch.setattr(cpu_ops, "greedy_logprob", lambda x: calls.append(x.shape) or kernel(x))
    from quiver_server.kernels.ops import select_ops

    ops = select_ops(CPU)  # the shard's choice here: the C++ kernels
    fused = sample(logits, params, ops=ops)
    assert calls == [(5, 1000)]
    # A sampled row or a repetition penalty keeps the torch path.
    sample(logits, SamplingBatch.from_params([SamplingParams(temperature=0.5)] * 5, CPU), ops=ops)
    assert len(calls) == 1
    monkeypatch.setenv("QUIVER_CPU_KERNELS", "0")
    torch_path = sample(logits, params)
    expected_tokens, expected_logprobs = _torch_greedy(logits)
    assert torch.equal(fused[0], expected_tokens) and torch.equal(torch_path[0], expected_tokens)
    # Each path within its own bound of the exact value: torch's sum order is its own, so it gets
    # the bound of the longest chain possible, the whole vocabulary.
    vocab = logits.shape[1]
    for logprobs, chain in ((fused[1], GREEDY_SUM_CHAIN), (torch_path[1], vocab)):
        error = (logprobs.double() - expected_logprobs.double()).abs()
        assert (error <= _greedy_logprob_error_bound(logits, expected_tokens, chain)).all(), error


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_a_greedy_batch_with_grammar_rows_keeps_free_rows_and_masks_the_others(
    monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """Constrained greedy rows take the argmax of what their mask allows, with the raw logprob
    (float64 log_softmax of the unmasked logits); free rows are what they are without a mask;
    alternatives stay raw. The same for the fused pass, the torch fallback, and a batch that a
    sampled row sends down the general path."""
    from quiver_server.grammar.masks import StepMask
    from quiver_server.kernels.ops import select_ops

    monkeypatch.setenv("QUIVER_CPU_KERNELS", kernels)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 1003, generator=gen) * 4
    rows = [1, 3]
    allowed = torch.rand(len(rows), 1003, generator=gen) < 0.1
    bias = torch.zeros(len(rows), 1003).masked_fill(~allowed, float("-inf"))
    exact = logits.double().log_softmax(dim=-1)
    expected = logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        expected[row] = logits[row].masked_fill(~allowed[i], float("-inf")).argmax()
    ops = select_ops(CPU) if kernels == "1" else None
    batches = {
        "greedy": [SamplingParams(top_logprobs=2 if r == 3 else 0) for r in range(5)],
        "general": [SamplingParams(temperature=0.8 if r == 4 else 0.0, top_logprobs=2 if r == 3 else 0)
                    for r in range(5)],
    }
    for name, row_params in batches.items():
        result = sample(logits, SamplingBatch.from_params(row_params, CPU), ops=ops, grammar=StepMask(rows, bias, 0))
        greedy_rows = [r for r in range(5) if row_params[r].temperature == 0]
        assert torch.equal(result.tokens[greedy_rows], expected[greedy_rows]), name
        for i, row in enumerate(rows):
            assert allowed[i, result.tokens[row]], name
        chosen = exact.gather(1, result.tokens[:, None])[:, 0]
        assert torch.allclose(result.logprobs.double(), chosen, atol=2e-5, rtol=0), name
        assert result.top is not None and result.top.rows == [3]
        raw_top = exact[3].topk(2)
        assert torch.equal(result.top.ids[0], raw_top.indices), name
        assert torch.allclose(result.top.logprobs[0].double(), raw_top.values, atol=2e-5, rtol=0), name
