"""Tensor parallelism on CPU (gloo, one process per rank, as `--num-shard` runs them): a model split
over 2 and 4 ranks answers as the whole model does — greedy tokens equal, logprobs and top
logprobs within 1e-4 — for the base and for adapters on every projection in one mixed batch, and
its greedy tokens are transformers'/peft's; each rank holds its share of the weights; shapes that
do not split are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_adapters import (
    ALL_PROJECTIONS,
    assert_greedy_matches,
    build_adapter,
    build_legacy_expert_adapter,
    peft_reference,
    reference_greedy,
)
from tiny_models import build_tiny_model
from tp_ranks import RankResult, Script, run_ranks, serve_script

from quiver_server.engine.engine import Engine
from quiver_server.models import family_for
from quiver_server.weights import load_config
from quiver_server.parallel import SINGLE, TensorParallel

ATOL = 1e-4
DECODE_STEPS = 6
PROMPTS = [([5, 9, 33, 2, 7, 100, 41], ""), ([8, 8, 9], "lora-all"), ([17, 250, 3, 3, 60], "lora-attention"),
           ([77, 12], "")]


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Script:
    root = tmp_path_factory.mktemp("tp")
    model = build_tiny_model(root / "llama", "llama", seed=3)  # 4 query heads, 2 KV heads
    adapters = root / "adapters"
    return Script(model, PROMPTS, DECODE_STEPS, adapters={
        "lora-all": build_adapter(model, adapters / "lora-all", seed=1, r=8, lora_alpha=16,
                                  target_modules=ALL_PROJECTIONS),
        "lora-attention": build_adapter(model, adapters / "lora-attention", seed=2, r=4, lora_alpha=8,
                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    })


@pytest.fixture(scope="module")
def whole(script: Script) -> RankResult:
    return serve_script(script, SINGLE)


@pytest.fixture(scope="module")
def split(script: Script):
    """The script's results on every rank of a split over `ranks`, each split run once."""
    runs: dict[int, list[RankResult]] = {}

    def on(ranks: int) -> list[RankResult]:
        if ranks not in runs:
            results = run_ranks(script, ranks)
            for rank, result in enumerate(results):
                assert not isinstance(result, str), f"rank {rank} of {ranks} failed: {result}"
            runs[ranks] = [result for result in results if not isinstance(result, str)]
        return runs[ranks]

    return on


def _assert_same_answers(got: RankResult, want: RankResult, what: str) -> None:
    assert got.steps.keys() == want.steps.keys()
    for request, steps in want.steps.items():
        assert [s[0] for s in got.steps[request]] == [s[0] for s in steps], f"{what}: request {request}'s tokens"
        for (_, logprob, top), (_, want_logprob, want_top) in zip(got.steps[request], steps, strict=True):
            assert abs(logprob - want_logprob) <= ATOL, f"{what}: request {request}"
            assert [t for t, _ in top] == [t for t, _ in want_top], f"{what}: request {request}'s alternatives"
            assert max(abs(a - b) for (_, a), (_, b) in zip(top, want_top, strict=True)) <= ATOL


@pytest.mark.parametrize("ranks", [2, 4])
def test_split_model_answers_as_the_whole_one(split, whole: RankResult, ranks: int) -> None:
    """2 ranks split the 2 KV heads; 4 ranks hold one KV head each, two ranks per head."""
    for rank, result in enumerate(split(ranks)):
        _assert_same_answers(result, whole, f"rank {rank} of {ranks}")
        assert result.kv_heads == 1  # this rank's KV cache holds its heads only


def test_split_model_answers_as_transformers_and_peft(script: Script, split) -> None:
    rank0 = split(2)[0]
    for request, (prompt, adapter) in enumerate(script.prompts):
        reference = peft_reference(script.model_dir, script.adapters[adapter] if adapter else None)
        want = reference_greedy(reference, prompt, DECODE_STEPS + 1)
        assert_greedy_matches([s[0] for s in rank0.steps[request]], want, f"request {request} ({adapter or 'base'})")


def test_each_rank_holds_and_reads_its_share_of_the_weights(script: Script, whole: RankResult, split) -> None:
    """Norm weights are whole on every rank; every projection, the embedding and the LM head are
    split in two; and a rank reads from the (float32) checkpoint only what it holds."""
    engine = Engine(str(script.model_dir), "tp-test", dtype="float32", device="cpu")
    norms = sum(p.numel() for name, p in engine.model.named_parameters() if name.endswith("norm.weight"))
    checkpoint = sum(f.stat().st_size for f in script.model_dir.glob("*.safetensors"))
    assert whole.checkpoint_bytes[0] == whole.checkpoint_bytes[1] == 4 * whole.held_numel
    assert checkpoint - 4096 < whole.checkpoint_bytes[1] <= checkpoint  # the file, less its header
    for result in split(2):
        assert result.held_numel == (whole.held_numel - norms) // 2 + norms
        assert result.checkpoint_bytes == (4 * result.held_numel, whole.checkpoint_bytes[1])


def test_a_rank_process_holds_half_the_memory_of_one_rank(tmp_path: Path) -> None:
    """Measured by the kernel: a rank of two holds about half the weight bytes one rank holds in
    anonymous memory (the rest of a process, torch and the runtime, is the same in both)."""
    model = build_tiny_model(tmp_path / "llama", "llama", seed=1, hidden_size=512, intermediate_size=2048,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=16000)
    script = Script(model, [([5, 9, 33], "")], 1)
    one, *two = [result for size in (1, 2) for result in run_ranks(script, size)]
    assert not isinstance(one, str), one
    weights = 4 * one.held_numel  # about 122 MiB
    for rank, result in enumerate(two):
        assert not isinstance(result, str), result
        saved = 1024 * (one.memory_kib["RssAnon"] - result.memory_kib["RssAnon"])
        assert 0.4 * weights < saved < 0.6 * weights, f"rank {rank} holds {saved / 2**20:.1f} MiB less than one rank"


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3"])
def test_other_dense_families_split_as_well(tmp_path: Path, arch: str) -> None:
    """Qwen3's per-head q/k norms; Gemma 2's sandwich norms, soft caps and scaled embedding: whole
    on every rank, or applied before the split and after the sums. Phi-3 stores q|k|v and gate|up
    fused: each rank loads its rows of every part, and an adapter's B on the fused projections
    splits the same way."""
    model = build_tiny_model(tmp_path / arch, arch, seed=7)
    targets = list(family_for(load_config(model)).layout.lora_targets)
    adapter = build_adapter(model, tmp_path / "every", seed=8, r=4, lora_alpha=8, target_modules=targets)
    script = Script(model, [([5, 9, 33, 2, 7, 100, 41], ""), ([8, 8, 9], "every")], DECODE_STEPS,
                    adapters={"every": adapter})
    results = run_ranks(script, 2)
    assert not isinstance(results[0], str), results[0]
    _assert_same_answers(results[0], serve_script(script, SINGLE), f"{arch} over 2 ranks")
    want = reference_greedy(peft_reference(model, adapter), [8, 8, 9], DECODE_STEPS + 1)
    assert_greedy_matches([s[0] for s in results[0].steps[1]], want, f"{arch} with an adapter, 2 ranks")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_sparse_models_split_every_expert(tmp_path: Path, arch: str) -> None:
    """Every expert's columns split over the ranks, the router whole: the base model and adapters
    on the attention, the router and every expert (PEFT's all-linear, and a per-expert adapter as
    transformers 4 names them) answer as over one rank, and as transformers/peft."""
    model = build_tiny_model(tmp_path / arch, arch, seed=11)
    adapters = {
        "all-linear": build_adapter(model, tmp_path / "all-linear", seed=12, r=4, lora_alpha=16,
                                    target_modules="all-linear"),
        "experts": build_legacy_expert_adapter(model, tmp_path / "experts", seed=13, r=6, lora_alpha=12),
    }
    script = Script(model, [([5, 9, 33, 2, 7, 100, 41], ""), ([8, 8, 9, 60], "all-linear"),
                            ([17, 250, 3], "experts")], DECODE_STEPS, adapters=adapters)
    whole = serve_script(script, SINGLE)
    results = run_ranks(script, 2)
    for rank, result in enumerate(results):
        assert not isinstance(result, str), f"rank {rank}: {result}"
        _assert_same_answers(result, whole, f"{arch} rank {rank}")
        assert result.held_numel < 0.55 * whole.held_numel  # the experts are split too, not only attention
    rank0 = results[0]
    assert not isinstance(rank0, str)
    for request, (prompt, adapter) in enumerate(script.prompts):
        want = reference_greedy(peft_reference(model, adapters[adapter] if adapter else None), prompt, DECODE_STEPS + 1)
        assert_greedy_matches([s[0] for s in rank0.steps[request]], want, f"{arch} request {request}")


def test_shapes_that_do_not_split_are_refused(script: Script) -> None:
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not split over 3 shards"):
        Engine(str(script.model_dir), "tp-test", dtype="float32", device="cpu", tp=TensorParallel(0, 3))


def test_a_quantized_split_model_answers_as_the_whole_quantized_one(tmp_path: Path) -> None:
    """--quantize quantizes each rank's share: per-channel int8 gives every rank's rows the scales
    the whole model's rows get, so the split model is the whole quantized model, exactly."""
    model = build_tiny_model(tmp_path / "llama", "llama", seed=5)
    script = Script(model, [([5, 9, 33, 2], ""), ([40, 41], "")], 4, quantize="int8")
    results = run_ranks(script, 2)
    assert not isinstance(results[0], str), results[0]
    _assert_same_answers(results[0], serve_script(script, SINGLE), "int8 over 2 ranks")
