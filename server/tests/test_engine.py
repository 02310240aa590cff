"""The Engine end to end: greedy generation through prefill + decode equals transformers'
`generate(do_sample=False)` token for token, alone, batched, across filter and merge; warmup
sizing; model info; and every bad input is a ValueError that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, build_tiny_model

from quiver_server.engine.batch_types import RequestSpec, SamplingParams
from quiver_server.engine.engine import Engine

NEW_TOKENS = 12
PROMPTS = {
    10: [5, 6, 7, 8, 9, 10, 11],
    11: [20, 21, 22],
    12: list(range(30, 70)),  # 40 tokens: the prompt spans three blocks
}
CACHE_GIB = 0.01


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[int, list[int]]]:
    """A tiny model and transformers' greedy continuation of each prompt, generated alone."""
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param,
                            seed=ARCHITECTURES.index(request.param))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = {}
    for rid, prompt in PROMPTS.items():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected[rid] = out[0, len(prompt) :].tolist()
    return path, expected


def _engine(path: Path, **kwargs: object) -> Engine:
    engine = Engine(str(path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=CACHE_GIB, **kwargs)
    engine.warmup(max_batch_prefill_tokens=256, max_total_tokens=128, max_batch_size=8)
    return engine


def _request(rid: int, first_block: int, max_new_tokens: int = NEW_TOKENS, **kwargs: object) -> RequestSpec:
    prompt = PROMPTS[rid]
    blocks = -(-(len(prompt) + max_new_tokens) // 16)
    return RequestSpec(
        id=rid, input_ids=prompt, blocks=list(range(first_block, first_block + blocks)),
        max_new_tokens=max_new_tokens, **kwargs,  # type: ignore[arg-type]
    )


def _collect(outputs: dict[int, list[int]], result) -> None:  # noqa: ANN001
    for generation in result.generations:
        outputs.setdefault(generation.request_id, []).append(generation.token_id)


def test_greedy_alone_and_batched_equals_transformers(model: tuple[Path, dict[int, list[int]]]) -> None:
    path, expected = model
    engine = _engine(path)
    for rid in PROMPTS:
        outputs: dict[int, list[int]] = {}
        _collect(outputs, engine.prefill(rid, [_request(rid, first_block=0)]))
        for _ in range(NEW_TOKENS - 1):
            _collect(outputs, engine.decode([rid]))
        engine.clear_cache(rid)
        assert outputs[rid] == expected[rid], f"request {rid} alone"

    outputs = {}
    requests = [_request(rid, first_block=10 * i) for i, rid in enumerate(PROMPTS)]
    _collect(outputs, engine.prefill(1, requests))
    for _ in range(NEW_TOKENS - 1):
        _collect(outputs, engine.decode([1]))
    assert outputs == expected


@pytest.mark.parametrize("overlap", [False, True], ids=["steps-in-turn", "next-step-launched-early"])
def test_filter_and_merge_keep_outputs(model: tuple[Path, dict[int, list[int]]], overlap: bool) -> None:
    """Also with each decode step launching the next one's forward before its tokens are read
    back (as on a GPU): used when the batch stays, cut to the rows a filter keeps, dropped when
    a merge changes it."""
    path, expected = model
    engine = _engine(path, overlap_steps=overlap)
    outputs: dict[int, list[int]] = {}
    result = engine.prefill(1, [_request(10, first_block=0), _request(11, first_block=10)])
    assert result.request_ids == [10, 11] and result.batch_id == 1
    _collect(outputs, result)
    for _ in range(3):
        _collect(outputs, engine.decode([1]))
        assert (engine._ahead is not None) == overlap  # the next step is in flight
    # A new request joins between steps: it is prefilled alone, then merged into batch 1.
    _collect(outputs, engine.prefill(2, [_request(12, first_block=20)]))
    merged = engine.decode([1, 2])
    assert merged.batch_id == 1 and merged.request_ids == [10, 11, 12]
    assert set(engine.batches) == {1}
    _collect(outputs, merged)
    # Request 11 finishes early and leaves the batch.
    assert engine.filter_batch(1, [12, 10]) == [10, 12]
    live = [10, 12]
    while live:
        result = engine.decode([1])
        assert result.request_ids == live
        _collect(outputs, result)
        # Like the router: a request that reached its max_new_tokens is filtered out.
        live = [rid for rid in live if len(outputs[rid]) < NEW_TOKENS]
        assert engine.filter_batch(1, live) == live
    assert outputs[10] == expected[10]
    assert outputs[11] == expected[11][: len(outputs[11])]
    assert outputs[12] == expected[12]
    assert engine.batches == {}


def test_logprobs_are_transformers_log_softmax(model: tuple[Path, dict[int, list[int]]]) -> None:
    path, _ = model
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = _engine(path)
    prompt = PROMPTS[10]
    first = engine.prefill(1, [_request(10, first_block=0)]).generations[0]
    second = engine.decode([1]).generations[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt + [first.token_id]])).logits[0], dim=-1)
    assert first.logprob == pytest.approx(logprobs[len(prompt) - 1, first.token_id].item(), abs=1e-4)
    assert second.logprob == pytest.approx(logprobs[len(prompt), second.token_id].item(), abs=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_stays_close_to_float32(tmp_path: Path, dtype: str) -> None:
    path = build_tiny_model(tmp_path, "qwen2")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), "tiny", dtype=dtype, device="cpu", cpu_kv_cache_gib=CACHE_GIB)
    assert engine.info.dtype == dtype
    engine.warmup(256, 128, 8)
    prompt = PROMPTS[12]
    first = engine.prefill(1, [_request(12, first_block=0)]).generations[0]
    second = engine.decode([1]).generations[0]
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt + [first.token_id]])).logits[0], dim=-1)
    # Half precision rounds, so only closeness to the float32 reference is expected.
    assert first.logprob == pytest.approx(logprobs[len(prompt) - 1, first.token_id].item(), abs=0.15)
    assert second.logprob == pytest.approx(logprobs[len(prompt), second.token_id].item(), abs=0.15)


def test_warmup_sizes_cpu_cache_from_gib_and_caps_it(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path, "llama")
    # 2 (K and V) * 2 layers * 16 slots * 2 kv heads * 16 head dim * 4 bytes
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    engine = Engine(str(path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=CACHE_GIB)
    with pytest.raises(ValueError, match="warmup"):
        engine.prefill(1, [_request(10, first_block=0)])
    assert engine.warmup(256, 128, 8) == (16, int(CACHE_GIB * 2**30) // bytes_per_block)
    assert engine.warmup(256, 128, 8, max_batch_total_tokens=1000) == (16, 63)
    assert engine.kv_cache is not None and engine.kv_cache.k[0].shape == (63, 16, 2, 16)


def test_info_reads_eos_from_generation_config_then_config(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path, "llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    info = Engine(str(path), "my-model", device="cpu").info
    assert info.eos_token_ids == [2, 7]
    assert (info.model_id, info.model_type, info.dtype, info.device) == ("my-model", "llama", "float32", "cpu")
    assert (info.vocab_size, info.max_position_embeddings, info.model_path) == (300, 1024, str(path))
    (path / "generation_config.json").unlink()
    assert Engine(str(path), "my-model", device="cpu").info.eos_token_ids == [2]


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        Engine(str(tmp_path), "gpt2", device="cpu")


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _engine(build_tiny_model(tmp_path_factory.mktemp("bad-input"), "llama"))


@pytest.mark.parametrize(
    ("request_spec", "message"),
    [
        (RequestSpec(id=1, input_ids=[], blocks=[0]), "empty prompt"),
        (RequestSpec(id=1, input_ids=[5, 300], blocks=[0, 1]), "token id 300 is out of range"),
        (RequestSpec(id=1, input_ids=list(range(10)), blocks=[0], max_new_tokens=7), "block table too short"),
        (RequestSpec(id=1, input_ids=[5], blocks=[10**6], max_new_tokens=4), "block ids"),
        (RequestSpec(id=1, input_ids=[5], blocks=[0], max_new_tokens=4, adapter_id="a"), "adapter 'a' is not active"),
        (RequestSpec(id=1, input_ids=[5], blocks=[0] * 80, max_new_tokens=1200), "max_position_embeddings"),
        (RequestSpec(id=1, input_ids=[5], blocks=[0], max_new_tokens=4, sampling=SamplingParams(top_p=0.0)), "top_p"),
        (RequestSpec(id=1, input_ids=[5], blocks=[0], max_new_tokens=4, sampling=SamplingParams(temperature=-1)),
         "temperature"),
    ],
    ids=["empty-prompt", "token-id", "short-block-table", "block-id", "adapter", "too-long", "top-p", "temperature"],
)
def test_bad_request_is_value_error(llama_engine: Engine, request_spec: RequestSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_engine.prefill(99, [request_spec])
    assert 99 not in llama_engine.batches


def test_bad_batch_operations_are_value_errors(llama_engine: Engine) -> None:
    with pytest.raises(ValueError, match="unknown batch id 42"):
        llama_engine.decode([42])
    with pytest.raises(ValueError, match="unknown batch id 42"):
        llama_engine.filter_batch(42, [])
    with pytest.raises(ValueError, match="at least one request"):
        llama_engine.prefill(5, [])
    llama_engine.prefill(5, [_request(10, first_block=0, max_new_tokens=2)])
    with pytest.raises(ValueError, match="already in use"):
        llama_engine.prefill(5, [_request(11, first_block=4)])
    with pytest.raises(ValueError, match=r"requests \[77\] are not in batch 5"):
        llama_engine.filter_batch(5, [10, 77])
    llama_engine.decode([5])
    # The request has used its 1 block (7 prompt + 2 new tokens fit; a third step would not):
    # the block table is the router's promise, so overrunning it is refused, not corrupted.
    llama_engine.decode([5])
    llama_engine.decode([5])
    with pytest.raises(ValueError, match="filled its 1 KV blocks"):
        for _ in range(16):
            llama_engine.decode([5])
    llama_engine.clear_cache(5)
    llama_engine.clear_cache(5)  # idempotent
    assert llama_engine.batches == {}


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.9, top_p=0.95, seed=4321, repetition_penalty=1.3),
], ids=["greedy", "seeded-sampling-with-penalty"])
def test_a_preempted_request_resumes_with_the_same_tokens(llama_engine: Engine, sampling: SamplingParams) -> None:
    """The router's recomputation: prompt + the tokens so far, draws_done = their count. The
    resumed run continues exactly where the undisturbed one went."""
    prompt, total, stop = PROMPTS[10], 16, 6

    def run(input_ids: list[int], new_tokens: int, params: SamplingParams, batch_id: int) -> list[int]:
        blocks = -(-(len(input_ids) + new_tokens) // 16)
        spec = RequestSpec(id=1, input_ids=input_ids, blocks=list(range(blocks)), sampling=params,
                           max_new_tokens=new_tokens)
        outputs: dict[int, list[int]] = {}
        _collect(outputs, llama_engine.prefill(batch_id, [spec]))
        for _ in range(new_tokens - 1):
            _collect(outputs, llama_engine.decode([batch_id]))
        llama_engine.clear_cache(batch_id)
        return outputs[1]

    straight = run(prompt, total, sampling, batch_id=1)
    first = run(prompt, stop, sampling, batch_id=2)
    assert first == straight[:stop]
    resumed = SamplingParams(**{**sampling.__dict__, "draws_done": stop})
    assert run(prompt + first, total - stop, resumed, batch_id=3) == straight[stop:]


def test_steps_launched_early_sample_what_steps_in_turn_sample(model: tuple[Path, dict[int, list[int]]]) -> None:
    """Seeded sampling with penalties and top logprobs: a decode step whose forward the previous
    step launched early gives the same tokens, draws and logprobs as one run in turn."""
    path, _ = model
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.2, frequency_penalty=0.3,
                              top_logprobs=3)
    runs = []
    for overlap in (False, True):
        engine = _engine(path, overlap_steps=overlap)
        outputs: dict[int, list[int]] = {}
        logprobs: list[float] = []
        requests = [_request(10, first_block=0, sampling=sampling), _request(12, first_block=10, sampling=sampling)]
        _collect(outputs, engine.prefill(1, requests))
        for _ in range(NEW_TOKENS - 1):
            result = engine.decode([1])
            _collect(outputs, result)
            logprobs += [g.logprob for g in result.generations]
        runs.append((outputs, logprobs))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == pytest.approx(runs[1][1], abs=1e-5)
