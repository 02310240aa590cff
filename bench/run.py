"""`make bench`: quiver end to end against transformers on the same random-weight Llama.

Starts the real stack (launcher → shard + router) on a free port, drives it with 1, 8 and 32
concurrent streaming clients (fixed-length token-id prompts, fixed output length with
ignore_eos), then stops it and runs the baselines on the same weights in this process. Prints
ONE JSON report on stdout and writes it to bench/results/; progress goes to stderr.

Scenarios are data (`Scenario`): issue 3 adds adapter scenarios (requests spread over 1/8/32
adapters) and the peft one-at-a-time baseline as new entries, not new code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(REPO_ROOT / "integration-tests"))  # stack.py: the same launcher helper

import torch  # noqa: E402

import bench_model  # noqa: E402
import hf_baseline  # noqa: E402
import load  # noqa: E402
import matmul_floor  # noqa: E402
from stack import Stack, StackConfig  # noqa: E402

SERVED_NAME = "bench"


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    adapters: tuple[str, ...] = ()  # issue 3: model names the requests cycle through


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="picks the model shape too: ~58M params on cpu, Llama-2-7B's on cuda")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, short outputs, one request per client")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per scenario and baseline; the report keeps the fastest of each")
    p.add_argument("--model-root", type=Path, default=REPO_ROOT / ".cache" / "bench-models")
    p.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.max_tokens = min(args.max_tokens, 16)
        args.requests_per_client = 1
        args.repeats = 1
    return args


def machine(device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                            capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def run_quiver(model_dir: Path, shape: bench_model.Shape, args, scenarios, prompts, logs: Path) -> dict:
    config = StackConfig(
        model_id=str(model_dir), served_model_name=SERVED_NAME, dtype=shape.dtype, device=args.device,
        cpu_kv_cache_gib=1.0 if args.device == "cpu" else None,
        max_total_tokens=args.prompt_tokens + args.max_tokens + 16,
        max_input_tokens=args.prompt_tokens + 8,
        max_batch_size=max(s.concurrency for s in scenarios),
    )
    results = {}
    stack = Stack(config, logs / "quiver.log")
    log(f"starting quiver ({shape.name}, {args.device}); log: {stack.log_path}")
    stack.start(timeout_s=900 if args.device == "cuda" else 120)
    try:
        for scenario in scenarios:
            workload = load.Workload(SERVED_NAME, prompts, args.max_tokens, args.requests_per_client,
                                     scenario.adapters)
            log(f"quiver {scenario.name}")
            results[scenario.name] = load.measure(stack.base_url + "/v1", workload, scenario.concurrency,
                                                  args.repeats)
    finally:
        stack.stop()
    return results


def run_transformers(model_dir: Path, shape: bench_model.Shape, args, scenarios, prompts) -> dict:
    log("transformers baseline: loading the same weights")
    model = hf_baseline.load(str(model_dir), args.device, shape.dtype)
    results = {}
    for scenario in scenarios:
        if scenario.adapters:
            continue  # base-model baseline only; peft's lives with the adapter scenarios
        log(f"transformers generate, batch {scenario.concurrency}")
        results[scenario.name] = hf_baseline.measure(model, args.device, prompts, scenario.concurrency,
                                                     args.max_tokens, args.repeats)
    del model
    bench_model.release_device_memory()
    return results


def build_report(args, shape, scenarios, quiver: dict, baselines: dict[str, dict]) -> dict:
    rows = []
    for scenario in scenarios:
        q = quiver[scenario.name]
        floor = matmul_floor.step_floor_s(shape, scenario.concurrency, args.device)
        row = {
            "scenario": scenario.name,
            "concurrency": scenario.concurrency,
            "adapters": len(scenario.adapters),
            "quiver": q,
            "baselines": {name: b[scenario.name] for name, b in baselines.items() if scenario.name in b},
            "decode_step": {
                "matmul_floor_s": round(floor, 6),
                "quiver_inter_token_p50_s": q["inter_token_s"].get("p50"),
            },
        }
        row["ratios"] = {
            f"quiver/{name}": round(q["throughput_tok_s"] / b["throughput_tok_s"], 3)
            for name, b in row["baselines"].items()
        }
        step = row["decode_step"]["quiver_inter_token_p50_s"]
        if step:
            row["decode_step"]["floor/quiver"] = round(floor / step, 3)
        rows.append(row)
    return {
        "benchmark": "quiver-bench/v1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "machine": machine(args.device),
        "model": {"shape": shape.name, "parameters": shape.parameters(), "dtype": shape.dtype,
                  "weights": "random", **{k: getattr(shape, k) for k in
                                         ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "vocab_size")}},
        "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "requests_per_client": args.requests_per_client, "repeats": args.repeats,
                     "sampling": "greedy",
                     "ignore_eos": True, "client": "openai SDK, streaming /v1/completions"},
        "scenarios": rows,
    }


def main() -> None:
    args = parse_args()
    shape = bench_model.SHAPES["tiny" if args.quick else args.device]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    scenarios = [Scenario(f"base-c{c}", c) for c in concurrencies]
    log(f"model {shape.name} ({shape.parameters() / 1e6:.0f}M params) under {args.model_root}")
    model_dir = bench_model.ensure_model(shape, args.model_root, args.device)
    count = max(concurrencies) * args.requests_per_client
    prompts = bench_model.prompts(count, args.prompt_tokens, shape.vocab_size)

    with tempfile.TemporaryDirectory(prefix="quiver-bench-") as tmp:
        quiver = run_quiver(model_dir, shape, args, scenarios, prompts, Path(tmp))
    baselines = {"transformers_generate": run_transformers(model_dir, shape, args, scenarios, prompts)}
    report = build_report(args, shape, scenarios, quiver, baselines)

    args.results_dir.mkdir(parents=True, exist_ok=True)
    kind = f"{args.device}-quick" if args.quick else args.device
    path = args.results_dir / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"report written to {path}")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
