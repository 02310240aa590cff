"""`make bench`'s model-family block (issue 25): quiver on a Qwen3-MoE-shaped and a
Gemma-3-shaped random model (bench/fixtures/family_shapes.py), base and 8 LoRA adapters, against
transformers.

Per family, on a stack of its own (prefix caching off: every repeat sends the same prompts):
- `base-c8`: 8 streams on the base model; between quiver's runs, transformers' batched
  `generate` on the same 8 prompts in the same dtype (repeats alternate, as in run.py);
- `lora8-c8`: the same 8 streams, stream i on adapter i (random peft adapters of ranks 8 and 16,
  bench/fixtures/adapters.py; "all-linear" on the MoE model, so the router and the experts carry
  LoRA too);
  after the stack stops, transformers + peft serving its first requests one at a time
  (peft_baseline.py);
- greedy agreement: quiver's base answers to the first requests against transformers' greedy
  on the same weights one request at a time, and its adapter answers against peft's.
Ratios are of medians over the repeats.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from bench.fixtures import adapters, bench_model, family_shapes, load
from bench.fixtures.stack import Stack, StackConfig
from bench.fixtures.stats import with_median
from bench.suite import hf_baseline, peft_baseline

SERVED_NAME = "bench"
STREAMS = 8
ADAPTERS = 8
AGREEMENT_REQUESTS = 8


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run(model_root: Path, device: str, shape_set: str, repeats: int, prompt_tokens: int, max_tokens: int,
        requests_per_client: int, naive_requests: int, logs: Path) -> dict:
    """The block: the workload, then one entry per family ({"error": ...} for a family that
    failed, so the other one is still reported)."""
    block: dict = {
        "streams": STREAMS, "adapters": ADAPTERS, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "requests_per_client": requests_per_client, "repeats": repeats, "prefix_caching": False,
        "adapter_ranks": list(adapters.RANKS),
        "greedy_agreement": f"quiver base against transformers greedy one request at a time (first "
                            f"{AGREEMENT_REQUESTS} requests), quiver adapters against peft's (the requests it timed)",
    }
    for shape in family_shapes.SHAPES[shape_set]:
        try:
            block[shape.family] = _family(shape, model_root, device, repeats, prompt_tokens, max_tokens,
                                          requests_per_client, naive_requests, logs)
        except Exception as err:  # noqa: BLE001 - reported, not hidden
            block[shape.family] = {"shape": shape.name, "error": f"{type(err).__name__}: {err}"}
            log(f"{shape.family} FAILED: {block[shape.family]['error']}")
    return block


def _family(shape: family_shapes.FamilyShape, model_root: Path, device: str, repeats: int, prompt_tokens: int,
            max_tokens: int, requests_per_client: int, naive_requests: int, logs: Path) -> dict:
    log(f"{shape.family}: model {shape.name} under {model_root}")
    model_dir = family_shapes.ensure_model(shape, model_root, device)
    adapter_root = model_root / f"{shape.name}-adapters"
    ids = adapters.ensure_adapters(model_dir, adapter_root, ADAPTERS, shape.dtype,
                                   target_modules=shape.target_modules)
    prompts = bench_model.prompts(STREAMS * requests_per_client, prompt_tokens, family_shapes.VOCAB_SIZE)
    base = load.Workload(SERVED_NAME, prompts, max_tokens, requests_per_client)
    lora = load.Workload(SERVED_NAME, prompts, max_tokens, requests_per_client, tuple(ids))
    stack = Stack(StackConfig(
        model_id=str(model_dir), served_model_name=SERVED_NAME, dtype=shape.dtype, device=device,
        cpu_kv_cache_gib=1.0 if device == "cpu" else None, max_total_tokens=prompt_tokens + max_tokens + 16,
        max_input_tokens=prompt_tokens + 8, max_batch_size=STREAMS,
        extra_args=adapters.server_flags(adapter_root, ADAPTERS, adapters.largest_rank(adapter_root, ids))
        + ["--prefix-caching", "false"],
    ), logs / f"quiver-{shape.name}.log")
    model = hf_baseline.load(str(model_dir), device, shape.dtype)
    runs: dict[str, list] = {"base": [], "lora": [], "generate": []}
    lora_error = None
    log(f"{shape.family}: starting quiver; log: {stack.log_path}")
    started = time.monotonic()
    stack.start(timeout_s=900 if device == "cuda" else 600)
    startup_s = round(time.monotonic() - started, 2)
    try:
        for repeat in range(repeats):
            log(f"{shape.family}, run {repeat + 1}/{repeats}: quiver base, {STREAMS} streams")
            runs["base"].append(load.measure(stack.base_url + "/v1", base, STREAMS, 1))
            log(f"{shape.family}, run {repeat + 1}/{repeats}: transformers generate, batch {STREAMS}")
            runs["generate"].append(hf_baseline.measure(model, device, prompts, STREAMS, max_tokens, repeats=1))
            if lora_error is None:
                log(f"{shape.family}, run {repeat + 1}/{repeats}: quiver, {STREAMS} streams over {ADAPTERS} adapters")
                try:
                    runs["lora"].append(load.measure(stack.base_url + "/v1", lora, STREAMS, 1))
                except Exception as err:  # noqa: BLE001 - reported beside the base figures
                    lora_error = f"{type(err).__name__}: {err}"
                    log(f"{shape.family}: adapters FAILED: {lora_error}")
    finally:
        stack.stop()
    quiver_base, base_texts = load.best_of(runs["base"])
    log(f"{shape.family}: transformers greedy, one request at a time (the agreement reference)")
    reference = [hf_baseline.greedy(model, device, p, max_tokens) for p in prompts[:AGREEMENT_REQUESTS]]
    row: dict = {
        "shape": family_shapes.describe(shape),
        "transformers_implementations": _implementations(model.config, shape),
        "adapter_targets": _targets(adapter_root / ids[0]),
        "quiver_startup_s": startup_s,
        "quiver_base_c8": with_median(quiver_base),
        "transformers_generate_c8": with_median({
            **hf_baseline.best_of(runs["generate"]),
            "throughput_tok_s_all_runs": [r["throughput_tok_s"] for r in runs["generate"]]}),
        "base_greedy_agreement": peft_baseline.agreement(base_texts, reference),
    }
    del model
    bench_model.release_device_memory()
    if lora_error is not None:
        row["quiver_lora8_c8"] = {"error": lora_error}
    else:
        quiver_lora, lora_texts = load.best_of(runs["lora"])
        row["quiver_lora8_c8"] = with_median(quiver_lora)
        row["peft_one_at_a_time"] = _peft(model_dir, adapter_root, ids, device, shape, lora, repeats,
                                          naive_requests, max_tokens, lora_texts)
    row["ratios_of_medians"] = _ratios(row)
    return row


def _peft(model_dir: Path, adapter_root: Path, ids: list[str], device: str, shape: family_shapes.FamilyShape,
          workload: load.Workload, repeats: int, naive_requests: int, max_tokens: int,
          quiver_texts: dict[int, str]) -> dict:
    log(f"{shape.family}: transformers+peft with {len(ids)} adapters, one request at a time")
    server = peft_baseline.PeftServer(model_dir, adapter_root, ids, device, shape.dtype)
    requests = workload.first_requests(STREAMS, naive_requests)
    result, outputs = server.measure(requests, max_tokens, repeats, STREAMS * workload.requests_per_client)
    del server
    bench_model.release_device_memory()
    walls = result["wall_s_all_runs"]
    result["throughput_tok_s_median"] = round(result["generated_tokens"] / statistics.median(walls), 2)
    result["agreement_with_quiver"] = peft_baseline.agreement(quiver_texts, outputs)
    return result


def _targets(adapter_dir: Path) -> dict:
    """What peft wrote an adapter for: modules, on an MoE the router and fused experts, and the
    ranks it gave modules other than `r`."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    targets = {key: sorted(config[key]) if isinstance(config.get(key), list) else config.get(key)
               for key in ("target_modules", "target_parameters")}
    return {"adapter": adapter_dir.name, **targets, "r": config["r"], "rank_pattern": config.get("rank_pattern")}


def _implementations(config, shape: family_shapes.FamilyShape) -> dict:
    """The kernels transformers picked by default (the baseline runs at its defaults)."""
    chosen = {"attention": config._attn_implementation}
    if "num_experts" in shape.config:
        chosen["experts"] = config._experts_implementation
    return chosen


def _ratios(row: dict) -> dict:
    def median(key: str) -> float | None:
        return row.get(key, {}).get("throughput_tok_s_median")

    base, generate, lora, naive = (median(k) for k in ("quiver_base_c8", "transformers_generate_c8",
                                                        "quiver_lora8_c8", "peft_one_at_a_time"))
    ratios = {"quiver_base_c8/transformers_generate_c8": round(base / generate, 2) if base and generate else None}
    if lora:
        ratios["quiver_lora8_c8/quiver_base_c8"] = round(lora / base, 2) if base else None
        ratios["quiver_lora8_c8/peft_one_at_a_time"] = round(lora / naive, 2) if naive else None
    return ratios
