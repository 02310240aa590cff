"""`make bench`'s step breakdown (issue 50): where a decode step and a prefill chunk of the demo
model (SmolLM2-135M-Instruct and its pirate adapter) spend their time, next to the bytes they
move and the host's measured stream bandwidth.

The shard's own `Engine` runs in this process, per dtype (float32, bfloat16, and the projections
quantized to int8 and int4 with float32 activations; "bfloat16-int8" etc. for 16-bit
activations; an "-a8" suffix, e.g. "int8-a8", adds `--quantize-activations int8`). The chat
prompts (bench/fixtures/real_prompts.py) are prefilled once; then 1, 8 and 32 streams decode
on the base and on the adapter (every row on it), and one prompt of 256 and of 1,024 tokens is
prefilled alone (bench/fixtures/step_runs.py says how). Per step:

- the components' times, measured by wrapping the engine's layers and ops at run time
  (bench/fixtures/step_timer.py): projections, LoRA deltas, attention, small ops (norms,
  rotary + KV write, SiLU, embedding, greedy), LM head, sampling, and the host's remainder
  (Python, planning, torch glue); the same steps unwrapped give the step as served;
- the bytes it must move (bench/fixtures/step_bytes.py: weights as held, K/V read and written,
  the adapter's A and B rows) and GB/s per component;
- the byte floor, bytes ÷ the stream bandwidth measured here, and the served step ÷ floor
  (the issue's target: ≤ 1.3 at 32 streams).

The router's share of a served token is not measured here: it needs a running stack, and is
the difference between a stack's inter-token p50 at one stream (the real-model and quantization
blocks) and this block's one-stream step.

Alone: `python -m bench.suite.step_breakdown --dtypes float32 --streams 1,8` prints the tables and
writes the JSON block to bench/results/step-breakdown-*.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from bench.fixtures import real_prompts, step_bytes
from bench.fixtures.paths import REPO_ROOT, RESULTS_DIR
from bench.fixtures.step_runs import EngineSteps, Plan, summarize, with_floor
from bench.fixtures.step_timer import COMPONENTS, HOST
from bench.suite import real_model
from bench.suite import report as reports

DTYPES = "float32,bfloat16,int8,int4,int8-a8,int4-a8"
ENGINE_MODEL_ID = "quiver-demo"


@dataclass(frozen=True)
class Setting:
    name: str
    dtype: str  # activations and unquantized weights
    quantize: str | None = None
    activations: str = "none"  # --quantize-activations

    @classmethod
    def parse(cls, name: str) -> Setting:
        """"float32", "bfloat16", "int8"/"int4" (float32 activations), "bfloat16-int8" etc.; a
        quantized one with "-a8" after it rounds the projections' inputs to int8."""
        base, a8, rest = name.partition("-a8")
        activations = "int8" if a8 else "none"
        dtype, _, quantize = base.partition("-")
        if dtype in ("int8", "int4") and not quantize:
            dtype, quantize = "float32", dtype
        known = dtype in ("float32", "bfloat16") and quantize in ("", "int8", "int4")
        if not known or rest or (a8 and not quantize):
            raise ValueError(f"unknown setting {name!r}: float32, bfloat16, int8, int4, bfloat16-int8, int8-a8, ...")
        return cls(name, dtype, quantize or None, activations)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def adapter_rank(adapter_dir: Path) -> int:
    return int(json.loads((adapter_dir / "adapter_config.json").read_text())["r"])


def build_engine(model_dir: Path, setting: Setting, prompts: list[list[int]], plan: Plan, adapter_dir: Path | None,
                 adapter_id: str):
    """The shard's engine on `model_dir` in `setting`, warmed up with one adapter slot (the adapter
    loaded and active when given) and a KV cache just large enough for `EngineSteps`."""
    from quiver_server.engine.engine import Engine

    engine = Engine(str(model_dir), ENGINE_MODEL_ID, dtype=setting.dtype, device="cpu", quantize=setting.quantize,
                    quantize_activations=setting.activations)
    blocks = EngineSteps.blocks_for(prompts, plan, engine.kv_spec.block_size)
    engine.cpu_kv_cache_gib = (blocks + 1) * engine.kv_spec.bytes_per_block() / 2**30
    longest = max([len(p) for p in prompts] + list(plan.prefill_chunks))
    rank = adapter_rank(adapter_dir) if adapter_dir is not None else 8
    engine.warmup(max(longest, 64), longest + plan.decode_room + 2, max(plan.streams), max_active_adapters=1,
                  max_lora_rank=rank)
    if adapter_dir is not None:
        engine.lora.load(adapter_id, "local", str(adapter_dir))
        engine.activate_adapter(adapter_id, 0)
    return engine


def breakdown(engine, prompts: list[list[int]], plan: Plan, adapter_id: str, stream_gb_s: float,
              title: str = "", out: TextIO = sys.stdout) -> dict:
    """Every decode configuration and prefill chunk of `plan` on one engine, its table printed to
    `out` as it goes."""
    runs = EngineSteps(engine, prompts, plan, adapter_id)
    block: dict = {"weight_bytes": vars(runs.weights), "kv_bytes_per_token": runs.kv_per_token,
                   "kv_cache_dtype": str(engine.kv_spec.dtype).removeprefix("torch."),
                   "ops": engine.ops.name, "prompt_fill": runs.fill_prompts(), "decode": {}, "prefill": {}}
    variants = [("base", False)] + ([("adapter", True)] if adapter_id else [])
    for streams in plan.streams:
        for variant, adapter in variants:
            name = f"{variant}-c{streams}"
            summary = summarize(*runs.decode(streams, adapter), runs.weights, stream_gb_s)
            summary["context_mean"] = round(summary["bytes"]["kv_read"] / runs.kv_per_token / streams - 1, 1)
            block["decode"][name] = summary
            print(table(f"{title} decode {name}", summary), file=out, flush=True)
    for index, tokens in enumerate(plan.prefill_chunks):
        for variant, adapter in variants:
            name = f"{variant}-{tokens}"
            summary = summarize(*runs.prefill_chunk(tokens, adapter, warm=index == 0), runs.weights,
                                stream_gb_s)
            summary["tokens_per_s"] = round(tokens / summary["plain_step_ms_p50"] * 1e3, 1)
            block["prefill"][name] = summary
            print(table(f"{title} prefill {name}", summary), file=out, flush=True)
    return block


def table(title: str, s: dict) -> str:
    moved = s["bytes"]
    lines = [
        f"== {title}: step {s['plain_step_ms_p50']:.2f} ms served (p50; {min(s['plain_step_ms_all']):.2f}-"
        f"{max(s['plain_step_ms_all']):.2f}), {s['timed_step_ms']:.2f} ms timed (mean); "
        f"floor {s['byte_floor_ms']:.2f} ms at {s['stream_gb_s']} GB/s -> x{s['step_to_floor']}",
        f"   bytes/step: weights {moved['weights'] / 1e6:.1f} MB, KV read {moved['kv_read'] / 1e6:.1f} MB, "
        f"KV written {moved['kv_written'] / 1e6:.2f} MB, adapter {moved['adapter'] / 1e6:.2f} MB "
        f"(step at {s['gb_s']['step']} GB/s)",
        f"   {'component':<12}{'ms':>9}{'share':>8}{'GB/s':>8}",
    ]
    rates = {"projections": s["gb_s"]["projections"], "lm_head": s["gb_s"]["lm_head"],
             "attention": s["gb_s"]["attention_kv"], "lora": s["gb_s"]["lora"]}
    for name in (*COMPONENTS, HOST):
        rate = rates.get(name)
        lines.append(f"   {name:<12}{s['components_ms'][name]:>9.3f}{s['components_share'][name]:>8.1%}"
                     f"{'' if rate is None else f'{rate:.1f}':>8}")
    if s.get("projection_gflop_s") is not None:
        lines.append(f"   projections at {s['projection_gflop_s']} GFLOP/s")
    return "\n".join(lines)


def run(model_root: Path, repeats: int, dtypes: str = DTYPES, streams: str = "1,8,32", steps: int = 8,
        warm_steps: int = 4, prefill_chunks: str = "256,1024", adapter: bool = True,
        out: TextIO = sys.stderr) -> dict:
    """The block for `make bench` (and alone): every setting of `dtypes` on the demo model; the
    tables go to `out` (stderr under `make bench`, whose stdout is the JSON report)."""
    from transformers import AutoTokenizer

    from quiver_server.host_malloc import keep_freed_memory

    # As the shard's process sets glibc's malloc up (freed activations stay mapped): without it a
    # prefill's activations are faulted in page by page every time. Best before threads start
    # (main() does it first); here the engine runs on the main thread, whose arena it sets.
    malloc_kept = keep_freed_memory()
    plan = Plan(streams=tuple(int(n) for n in streams.split(",") if n.strip()), warm_steps=warm_steps, steps=steps,
                repeats=repeats, prefill_chunks=tuple(int(n) for n in prefill_chunks.split(",") if n.strip()))
    settings = [Setting.parse(name.strip()) for name in dtypes.split(",") if name.strip()]
    demo = real_model.ensure_demo(model_root)
    adapter_dir = demo / "adapters" / real_model.ADAPTER if adapter else None
    prompts = real_prompts.prompt_ids(AutoTokenizer.from_pretrained(demo), max(plan.streams))
    measurements: list[dict] = []

    def best_bandwidth() -> float:
        """A new measurement; the best of all so far (taken before each setting and at the end:
        the floor uses the best the host showed during the block)."""
        figures = step_bytes.stream_bandwidth()
        measurements.append(figures)
        log(f"step breakdown: stream bandwidth {figures['stream_gb_s']} GB/s ({figures['stream_op']}; "
            + ", ".join(f"{k} {v}" for k, v in figures.items() if k.endswith("_gb_s") and k != "stream_gb_s") + ")")
        return max(m["stream_gb_s"] for m in measurements)

    block: dict = {
        "model": "SmolLM2-135M-Instruct (the demo), in-process Engine on CPU",
        "adapter": f"{real_model.ADAPTER} (rank {adapter_rank(adapter_dir)}, q/k/v/o), every row on it"
                   if adapter_dir else None,
        "host": {**reports.cpu_description(), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()},
        "plan": {"streams": list(plan.streams), "warm_steps": plan.warm_steps, "steps_per_round": plan.steps,
                 "rounds": plan.repeats, "prefill_chunks": list(plan.prefill_chunks)},
        "prompts": real_prompts.length_summary(prompts),
        "method": "components timed by wrapping the engine's layers and ops at run time (exclusive times; host = "
                  "step - components; means per step); decode streams admitted as prefix-cache hits on the "
                  "prompts' blocks; served step = the same steps unwrapped (p50); floor = bytes per step / the best "
                  "stream bandwidth measured during the block",
        "malloc_like_the_shard": malloc_kept,
        "router": "not measured here (needs a stack): a stack's one-stream inter-token p50 minus base-c1's step",
        "settings": {},
    }
    for setting in settings:
        stream_gb_s = best_bandwidth()
        log(f"step breakdown: {setting.name} (dtype {setting.dtype}, quantize {setting.quantize}, activations "
            f"{setting.activations})")
        started = time.perf_counter()
        engine = build_engine(demo, setting, prompts, plan, adapter_dir, real_model.ADAPTER)
        result = breakdown(engine, prompts, plan, real_model.ADAPTER if adapter_dir else "", stream_gb_s,
                           setting.name, out)
        block["settings"][setting.name] = {"dtype": setting.dtype, "quantize": setting.quantize,
                                           "activations": setting.activations, **result,
                                           "wall_s": round(time.perf_counter() - started, 1)}
        del engine
    stream_gb_s = best_bandwidth()
    best = max(measurements, key=lambda m: m["stream_gb_s"])
    block["stream_bandwidth"] = {"stream_gb_s": stream_gb_s, "stream_op": best["stream_op"],
                                 "measurements": measurements}
    for result in block["settings"].values():
        for kind in ("decode", "prefill"):
            result[kind] = {name: with_floor(row, stream_gb_s) for name, row in result[kind].items()}
    block["step_to_floor"] = {name: {variant: row["step_to_floor"] for variant, row in r["decode"].items()}
                              for name, r in block["settings"].items()}
    print(floor_table(block), file=out, flush=True)
    return block


def floor_table(block: dict) -> str:
    """Every decode configuration's served step against its floor at the block's best bandwidth."""
    bandwidth = block["stream_bandwidth"]
    lines = [f"== decode steps against the byte floor at {bandwidth['stream_gb_s']} GB/s ({bandwidth['stream_op']})",
             f"   {'setting':<16}{'config':<14}{'step ms':>9}{'floor ms':>10}{'x floor':>9}{'MB/step':>9}"]
    for name, result in block["settings"].items():
        for config, row in result["decode"].items():
            lines.append(f"   {name:<16}{config:<14}{row['plain_step_ms_p50']:>9.2f}{row['byte_floor_ms']:>10.2f}"
                         f"{row['step_to_floor']:>9.2f}{row['bytes']['total'] / 1e6:>9.1f}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default=DTYPES, help="comma-separated settings: float32, bfloat16, int8, int4, "
                                                    "bfloat16-int8, bfloat16-int4; -a8 after a quantized one: "
                                                    "int8 activations (int8-a8)")
    p.add_argument("--streams", default="1,8,32", help="comma-separated decode stream counts")
    p.add_argument("--repeats", type=int, default=2, help="rounds of (timed, plain) decode steps per configuration")
    p.add_argument("--steps", type=int, default=8, help="decode steps per round, timed and plain each")
    p.add_argument("--warm-steps", type=int, default=4, help="untimed decode steps first")
    p.add_argument("--prefill-chunks", default="256,1024", help="comma-separated prefill lengths ('' for none)")
    p.add_argument("--no-adapter", action="store_true", help="the base only")
    p.add_argument("--model-root", type=Path, default=REPO_ROOT / ".cache" / "bench-models")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args()


def main() -> None:
    from quiver_server.host_malloc import keep_freed_memory

    keep_freed_memory()  # before torch starts its threads, as the shard does
    args = parse_args()
    block = run(args.model_root, args.repeats, args.dtypes, args.streams, args.steps, args.warm_steps,
                args.prefill_chunks, adapter=not args.no_adapter, out=sys.stdout)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"step-breakdown-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"step_breakdown": block}, indent=2) + "\n")
    log(f"report written to {path}")


if __name__ == "__main__":
    main()
