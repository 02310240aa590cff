"""The step breakdown's accounting (bench/suite/step_breakdown.py and its fixtures) on the tiny
model with a peft-written adapter: the components and the host's remainder add up to each
measured step, the bytes per step follow from the model's config (not from the engine's own
tensors), and timing a step changes neither its tokens nor the engine once the timers are out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from adapter_models import build_adapter

from bench.fixtures.step_runs import EngineSteps, Plan, summarize
from bench.fixtures.step_timer import COMPONENTS, HOST, OP_COMPONENTS, StepTimer, instrument
from bench.suite import step_breakdown

from quiver_server.engine.batch_types import RequestSpec
from quiver_server.kernels import cpu_gemm, quant_gemm
from quiver_server.tiny_model import write_tiny_model

ADAPTER = "tiny-adapter"
RANK = 4
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPTS = [[5 + (i * 7 + j * 13) % 900 for j in range(length)] for i, length in enumerate((21, 37, 50))]
PLAN = Plan(streams=(1, 3), warm_steps=1, steps=2, repeats=1, prefill_chunks=(40,))
FLOAT32 = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("step-breakdown")
    base = Path(write_tiny_model(root / "tiny"))
    adapter = build_adapter(base, root / "adapter", seed=5, r=RANK, lora_alpha=8, target_modules=TARGETS)
    with pytest.MonkeyPatch.context() as patch:
        # Plain float32 weights: their bytes are exactly the shapes' (the packed layout pads).
        patch.setenv("QUIVER_CPU_PACKED_WEIGHTS", "0")
        engine = step_breakdown.build_engine(base, step_breakdown.Setting.parse("float32"), PROMPTS, PLAN, adapter,
                                             ADAPTER)
    config = json.loads((base / "config.json").read_text())
    return engine, config


def test_components_and_host_add_up_to_every_step(tiny) -> None:
    engine, _ = tiny
    runs = EngineSteps(engine, PROMPTS, PLAN, ADAPTER)
    runs.fill_prompts()
    steps, plain = runs.decode(3, adapter=True)
    assert len(steps) == len(plain) == PLAN.steps * PLAN.repeats
    for step in steps:
        assert sum(step.parts_ns.values()) == step.total_ns
        assert step.parts_ns[HOST] >= 0
        assert all(step.parts_ns[name] > 0 for name in COMPONENTS), step.parts_ns
    summary = summarize(steps, plain, runs.weights, stream_gb_s=10.0)
    assert sum(summary["components_ms"].values()) == pytest.approx(summary["timed_step_ms"], abs=0.01)

    chunk_steps, _ = runs.prefill_chunk(40, adapter=False, warm=False)
    (chunk,) = chunk_steps
    assert sum(chunk.parts_ns.values()) == chunk.total_ns and chunk.parts_ns[HOST] >= 0
    assert chunk.calls["attention/prefill_attention"] == json.loads(
        (Path(engine.info.model_path) / "config.json").read_text())["num_hidden_layers"]


def test_bytes_per_step_follow_the_model_shapes(tiny) -> None:
    engine, config = tiny
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    projections = layers * (hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden) * FLOAT32
    kv_per_token = layers * 2 * kv * FLOAT32
    widths = {"q_proj": (hidden, q), "v_proj": (hidden, kv), "down_proj": (inter, hidden)}
    adapter = layers * sum(RANK * (i + o) for i, o in (widths[t] for t in TARGETS)) * FLOAT32

    runs = EngineSteps(engine, PROMPTS, PLAN, ADAPTER)
    assert (runs.weights.projections, runs.weights.lm_head) == (projections, vocab * hidden * FLOAT32)
    assert runs.weights.other == (2 * layers + 1) * hidden * FLOAT32  # the norms
    assert runs.weights.embedding_row == hidden * FLOAT32
    runs.fill_prompts()
    steps, plain = runs.decode(3, adapter=True)
    first = steps[0]
    # Admitted with a prompt's length in the cache, one warm step, then this step's new token.
    assert first.kv_read == sum(len(p) + 2 for p in PROMPTS) * kv_per_token
    assert first.kv_written == 3 * kv_per_token
    assert first.adapter_bytes == adapter
    assert first.projection_bytes == projections
    assert first.projection_macs == 3 * projections // FLOAT32

    summary = summarize(steps, plain, runs.weights, stream_gb_s=10.0)
    weights = projections + vocab * hidden * FLOAT32 + (2 * layers + 1) * hidden * FLOAT32 + 3 * hidden * FLOAT32
    assert summary["bytes"]["weights"] == weights
    total = summary["bytes"]["total"]
    assert total == weights + summary["bytes"]["kv_read"] + 3 * kv_per_token + adapter
    assert summary["byte_floor_ms"] == pytest.approx(total / 10e9 * 1e3, abs=1e-3)
    assert summary["step_to_floor"] == pytest.approx(summary["plain_step_ms_p50"] / summary["byte_floor_ms"],
                                                     rel=0.01)
    base_steps, _ = runs.decode(3, adapter=False)
    assert base_steps[0].adapter_bytes == 0


def _greedy(engine, batch_id: int, blocks: list[int], steps: int, timer: StepTimer | None) -> list[int]:
    prompt = PROMPTS[1]
    spec = RequestSpec(id=batch_id, input_ids=prompt, blocks=blocks, max_new_tokens=steps + 1, adapter_id=ADAPTER)
    tokens = [engine.prefill(batch_id, [spec]).generations[0].token_id]
    for _ in range(steps):
        if timer is None:
            tokens.append(engine.decode([batch_id]).generations[0].token_id)
        else:
            with instrument(engine, timer):
                tokens.append(engine.decode([batch_id]).generations[0].token_id)
    engine.clear_cache(batch_id)
    return tokens


def test_timers_change_no_token_and_leave_nothing_behind(tiny) -> None:
    engine, config = tiny
    originals = (cpu_gemm.linear, quant_gemm.linear)
    timer = StepTimer()
    timed = _greedy(engine, 901, list(range(0, 5)), 6, timer)
    assert timer.take()["calls"]["attention/decode_attention"] == 6 * config["num_hidden_layers"]
    plain = _greedy(engine, 902, list(range(5, 10)), 6, None)
    assert timed == plain
    assert not set(OP_COMPONENTS) & set(vars(engine.ops))
    assert all("forward" not in vars(m) for m in engine.model.modules())
    wrappers = ("timed_call", "counted", "maybe_timed")
    held = [v for m in [*engine.model.modules(), *engine.model.rotaries] for v in vars(m).values()]
    assert not [v for v in held if getattr(v, "__name__", "") in wrappers]
    assert (cpu_gemm.linear, quant_gemm.linear) == originals
