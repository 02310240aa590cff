"""OpenAI's presence/frequency penalties and logit_bias: the processed scores against the formula
written out here token by token, greedy generation against transformers' logits with that
formula applied, a resumed request counting its generated prompt tokens, seeded sampling that
does not depend on the batch, and the engine refusing out-of-range values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from tiny_adapters import TIE_TOLERANCE
from tiny_models import build_tiny_model
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from quiver_server.engine.batch_types import RequestSpec, SamplingParams, TokenOut
from quiver_server.engine.engine import Engine
from quiver_server.engine.penalties import generated_counts
from quiver_server.engine.sampling import SamplingBatch, process_scores, sample

CPU = torch.device("cpu")
VOCAB = 300
NEW_TOKENS = 10
BASE_PROMPT = [5, 6, 7, 8]


def openai_scores(
    logits: list[float], generated: list[int], params: SamplingParams, history: list[int] | None = None
) -> list[float]:
    """OpenAI's documented adjustment, one token at a time: mu[j] - c[j] * frequency_penalty -
    float(c[j] > 0) * presence_penalty + logit_bias[j], where c[j] counts j among the generated
    tokens only. `history` (prompt + generated) feeds transformers' repetition penalty first."""
    scores = list(logits)
    if params.repetition_penalty != 1.0:
        assert history is not None
        row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
            torch.tensor([history]), torch.tensor([scores]))
        scores = row[0].tolist()
    for j in range(len(scores)):
        c = generated.count(j)
        scores[j] = scores[j] - c * params.frequency_penalty - float(c > 0) * params.presence_penalty
        scores[j] += params.logit_bias.get(j, 0.0)
    return scores


def test_processed_scores_follow_openai_formula() -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 60, generator=generator) * 3
    rows = [  # (prompt, generated, params)
        ([1, 2, 3, 3], [7, 7, 9, 1], SamplingParams(presence_penalty=0.5)),
        ([4, 4, 4], [4, 11, 11, 11, 12], SamplingParams(frequency_penalty=1.2)),
        ([20, 21], [20, 22, 22], SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0)),
        ([30], [31, 32], SamplingParams()),  # untouched in a batch that penalises others
        ([5, 6], [6, 6, 8], SamplingParams(frequency_penalty=0.7, logit_bias={8: -3.5, 50: 4.0})),
        ([9, 9, 10], [10, 13], SamplingParams(repetition_penalty=1.3, presence_penalty=2.0, logit_bias={0: 1.0})),
    ]
    params = SamplingBatch.from_params([p for _, _, p in rows], CPU)
    seen = torch.zeros(6, 60, dtype=torch.bool)
    for row, (prompt, generated, _) in enumerate(rows):
        seen[row, prompt + generated] = True
    # The shard's counts: a resumed request's prompt holds its generated tokens at the end.
    counts = torch.stack([generated_counts(p + g, len(g), 60, CPU) for p, g, _ in rows])
    ours = process_scores(logits, params, seen, counts)
    for row, (prompt, generated, p) in enumerate(rows):
        expected = openai_scores(logits[row].tolist(), generated, p, prompt + generated)
        torch.testing.assert_close(ours[row], torch.tensor(expected), atol=1e-5, rtol=0, msg=f"row {row}")
    tokens, logprobs, top = sample(logits, params, None, seen, counts=counts)
    assert tokens.tolist() == [max(range(60), key=ours[r].__getitem__) for r in range(6)]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    assert top is None


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("penalties"), "llama", seed=6)


@pytest.fixture(scope="module")
def reference(model_path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    engine = Engine(str(model_path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 8)
    return engine


@torch.no_grad()
def reference_greedy(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, count_prompt: bool = False
) -> tuple[list[int], list[list[float]]]:
    """Greedy on openai_scores of transformers' logits; the scores behind every choice.
    count_prompt: the wrong reading (prompt tokens counted too), to show the test tells them apart."""
    sequence: list[int] = list(prompt)
    tokens, scores_per_step = [], []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([sequence])).logits[0, -1].tolist()
        scores = openai_scores(logits, sequence if count_prompt else tokens, params)
        tokens.append(max(range(VOCAB), key=scores.__getitem__))
        sequence.append(tokens[-1])
        scores_per_step.append(scores)
    return tokens, scores_per_step


def assert_greedy_equal(got: list[int], expected: tuple[list[int], list[list[float]]], what: str) -> None:
    """Equal, except past a step where the reference's two best scores tie (DESIGN.md's rule)."""
    tokens, scores = expected
    for step, (token, want) in enumerate(zip(got, tokens, strict=True)):
        if token != want:
            best, second = sorted(scores[step], reverse=True)[:2]
            assert best - second < TIE_TOLERANCE, f"{what}: diverged at {step}: {got} vs {tokens}"
            return


def generate(engine: Engine, requests: list[tuple[list[int], SamplingParams]], steps: int = NEW_TOKENS,
             filter_at: int | None = None) -> list[list[TokenOut]]:
    """Runs the requests as one batch (ids = their index); with `filter_at`, the first request is
    dropped after that many tokens. Returns each request's generations."""
    specs = [
        RequestSpec(id=i, input_ids=prompt, blocks=[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3], sampling=params,
                    max_new_tokens=steps)
        for i, (prompt, params) in enumerate(requests)
    ]
    outputs: list[list[TokenOut]] = [[] for _ in specs]
    result = engine.prefill(0, specs)
    for step in range(steps):
        for generation in result.generations:
            outputs[generation.request_id].append(generation)
        if step == steps - 1:
            break
        if filter_at is not None and step + 1 == filter_at and len(specs) > 1:
            engine.filter_batch(0, [s.id for s in specs[1:]])
        result = engine.decode([0])
    engine.clear_cache(0)
    return outputs


def _tokens(generations: list[TokenOut]) -> list[int]:
    return [g.token_id for g in generations]


PENALISED = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
NEGATIVE = SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0, logit_bias={17: 3.0, 40: -2.0})


def test_greedy_with_penalties_equals_the_formula_on_transformers_logits(
    engine: Engine, reference: torch.nn.Module
) -> None:
    # A prompt of the model's own favourite tokens: counting the prompt would change the output.
    plain, _ = reference_greedy(reference, BASE_PROMPT, SamplingParams())
    prompt = BASE_PROMPT + plain[:6]
    expected = reference_greedy(reference, prompt, PENALISED)
    assert expected[0] != reference_greedy(reference, prompt, PENALISED, count_prompt=True)[0]
    assert expected[0] != reference_greedy(reference, prompt, SamplingParams())[0]
    outputs = generate(engine, [(prompt, PENALISED), (prompt, SamplingParams()), (BASE_PROMPT, NEGATIVE)])
    assert_greedy_equal(_tokens(outputs[0]), expected, "penalised")
    assert_greedy_equal(_tokens(outputs[1]), reference_greedy(reference, prompt, SamplingParams()), "plain")
    assert_greedy_equal(_tokens(outputs[2]), reference_greedy(reference, BASE_PROMPT, NEGATIVE), "negative")
    # The reported logprob stays the raw distribution's, not the penalised one's.
    with torch.no_grad():
        raw = torch.log_softmax(reference(torch.tensor([prompt + _tokens(outputs[0])])).logits[0], -1)
    for step, generation in enumerate(outputs[0]):
        assert generation.logprob == pytest.approx(raw[len(prompt) - 1 + step, generation.token_id].item(), abs=1e-4)


def test_a_resumed_request_counts_its_generated_prompt_tokens(engine: Engine, reference: torch.nn.Module) -> None:
    """Preempted after 4 tokens, resumed with them at the end of its prompt and draws_done=4: it
    goes on as if it had never stopped (those 4 count as generated, the prompt does not)."""
    full = _tokens(generate(engine, [(BASE_PROMPT, PENALISED)])[0])
    assert_greedy_equal(full, reference_greedy(reference, BASE_PROMPT, PENALISED), "uninterrupted")
    resumed_params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, draws_done=4)
    resumed = generate(engine, [(BASE_PROMPT + full[:4], resumed_params)], steps=NEW_TOKENS - 4)[0]
    assert _tokens(resumed) == full[4:]
    # Without draws_done the same prompt is a fresh request, and the penalties start from zero.
    fresh = _tokens(generate(engine, [(BASE_PROMPT + full[:4], PENALISED)], steps=NEW_TOKENS - 4)[0])
    assert fresh != full[4:]


def test_logit_bias_forces_and_removes_tokens(engine: Engine, reference: torch.nn.Module) -> None:
    plain, _ = reference_greedy(reference, BASE_PROMPT, SamplingParams())
    forced, banned = 123, plain[0]
    outputs = generate(engine, [
        (BASE_PROMPT, SamplingParams(logit_bias={forced: 100.0})),
        (BASE_PROMPT, SamplingParams(logit_bias={banned: -100.0})),
        (BASE_PROMPT, SamplingParams(temperature=1.0, seed=3, logit_bias={forced: 100.0})),
        (BASE_PROMPT, SamplingParams()),
    ])
    assert _tokens(outputs[0]) == [forced] * NEW_TOKENS
    assert _tokens(outputs[2]) == [forced] * NEW_TOKENS
    assert banned not in _tokens(outputs[1])
    assert_greedy_equal(_tokens(outputs[1]), reference_greedy(reference, BASE_PROMPT, SamplingParams(
        logit_bias={banned: -100.0})), "banned")
    assert _tokens(outputs[3]) == plain
    with torch.no_grad():
        raw = torch.log_softmax(reference(torch.tensor([BASE_PROMPT])).logits[0, -1], -1)
    # Forced, but reported with its raw (unbiased) logprob: far from 0.
    assert outputs[0][0].logprob == pytest.approx(raw[forced].item(), abs=1e-4)
    assert raw[forced].item() < -1.0


def test_seeded_tokens_with_penalties_do_not_depend_on_the_batch(engine: Engine) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=77, frequency_penalty=0.8, presence_penalty=-0.4,
                            logit_bias={33: 2.0, 34: -1.0})
    alone = _tokens(generate(engine, [([11, 12, 13], seeded)])[0])
    others = [
        ([40, 41, 42, 43], SamplingParams(temperature=1.2, seed=5, presence_penalty=2.0, repetition_penalty=1.3)),
        ([11, 12, 13], seeded),
        ([7], SamplingParams(top_logprobs=3, logit_bias={9: 5.0})),
        ([50, 51], SamplingParams(temperature=0.7, seed=9, frequency_penalty=-2.0, top_logprobs=20)),
    ]
    batched = generate(engine, others, filter_at=3)
    assert _tokens(batched[1]) == alone
    # And the penalties matter: without them the same seed draws other tokens.
    assert _tokens(generate(engine, [([11, 12, 13], SamplingParams(temperature=0.9, top_p=0.95, seed=77))])[0]) != alone


@pytest.mark.parametrize(
    ("params", "prompt_logprobs", "message"),
    [
        (SamplingParams(presence_penalty=2.5), None, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (SamplingParams(frequency_penalty=-2.01), None, "frequency_penalty must be in"),
        (SamplingParams(frequency_penalty=math.nan), None, "frequency_penalty must be in"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), None, "logit_bias token id 300 is out of range for vocab size 300"),
        (SamplingParams(logit_bias={5: math.inf}), None, "logit_bias of token 5 must be finite"),
        (SamplingParams(logit_bias={5: math.nan}), None, "logit_bias of token 5 must be finite"),
        (SamplingParams(top_logprobs=21), None, r"top_logprobs must be in \[0, 20\], got 21"),
        (SamplingParams(), 21, r"prompt_logprobs must be in \[0, 20\], got 21"),
    ],
    ids=["presence", "frequency", "frequency-nan", "bias-id", "bias-inf", "bias-nan", "top-logprobs",
         "prompt-logprobs"],
)
def test_out_of_range_values_are_refused(
    engine: Engine, params: SamplingParams, prompt_logprobs: int | None, message: str
) -> None:
    request = RequestSpec(id=1, input_ids=[5, 6], blocks=[0], max_new_tokens=4, sampling=params,
                          prompt_logprobs=prompt_logprobs)
    with pytest.raises(ValueError, match=message):
        engine.prefill(99, [request])
    assert 99 not in engine.batches
    # The limits themselves are accepted.
    limits = SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, top_logprobs=20,
                            logit_bias={VOCAB - 1: -100.0})
    edge = RequestSpec(id=1, input_ids=[5, 6], blocks=[0], max_new_tokens=4, prompt_logprobs=20, sampling=limits)
    engine.prefill(98, [edge])
    engine.clear_cache(98)
