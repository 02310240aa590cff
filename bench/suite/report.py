"""The JSON report of `make bench`: one row per scenario (quiver's figures, the baselines of the
same scenario, the ratios between them, the decode step against the matmul floor) and, with
adapter scenarios, issue 3's two multi-LoRA targets read off the one with the most adapters."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from bench.fixtures import adapters
from bench.fixtures.paths import REPO_ROOT
from bench.kernels import matmul_floor

# Issue 3's targets for the adapter scenario with the most adapters.
TARGET_VS_BASE = 0.8  # × quiver's base-only throughput at the same concurrency
TARGET_VS_NAIVE = 8.0  # × transformers + peft one request at a time
# Issue 13's target for the logprobs scenario: × the same streams without logprobs.
TARGET_LOGPROBS_VS_BASE = 0.9
# Issue 14's targets: half the streams under a JSON schema × the same streams all free, and the
# free streams' inter-token p99 while 8 new schemas compile × just before (at most).
TARGET_STRUCTURED_VS_FREE = 0.9
TARGET_STALL_P99 = 1.10


def cpu_description() -> dict:
    """The CPU model, its vector flags, and the ISA the shard's C++ kernels are built for (the
    figures depend on all three: QUIVER_CPU_ISA=avx2 runs the AVX2 build on an AVX-512 host)."""
    from quiver_server.kernels import cpu_ops

    model, flags = cpu_ops.cpu_model_and_flags()
    return {
        "kernel_isa": cpu_ops.selected_isa(),
        "kernel_isas_runnable": cpu_ops.host_isas(),
        "cpu_model": model,
        "cpu_vector_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))),
    }


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
    else:
        info.update(cpu_description())
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                            capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 3)


def _adapter_ranks(scenario) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for index in range(len(scenario.adapters)):  # scenario.adapters = adapters.ids(n)
        rank = str(adapters.rank_of(index))
        ranks[rank] = ranks.get(rank, 0) + 1
    return ranks


def build_row(args, shape, scenario, quiver: dict, baselines: dict[str, dict]) -> dict:
    q = quiver[scenario.name]
    if "error" in q:
        return {"scenario": scenario.name, "concurrency": scenario.concurrency,
                "adapters": len(scenario.adapters), "quiver": q,
                "baselines": {name: b[scenario.name] for name, b in baselines.items() if scenario.name in b},
                "ratios": {}}
    floor = matmul_floor.step_floor_s(shape, scenario.concurrency, args.device)
    row = {
        "scenario": scenario.name,
        "concurrency": scenario.concurrency,
        "adapters": len(scenario.adapters),
        "quiver": q,
        "baselines": {name: b[scenario.name] for name, b in baselines.items() if scenario.name in b},
        "decode_step": {
            # The base model's weight matmuls only: LoRA's extra work is not in the floor.
            "matmul_floor_s": round(floor, 6),
            "quiver_inter_token_p50_s": q["inter_token_s"].get("p50"),
        },
    }
    row["ratios"] = {f"quiver/{name}": _ratio(q["throughput_tok_s"], b["throughput_tok_s"])
                     for name, b in row["baselines"].items()}
    if scenario.adapters:
        row["adapter_ranks"] = _adapter_ranks(scenario)
    if scenario.logprobs:
        row["logprobs"] = scenario.logprobs
    if scenario.adapters or scenario.logprobs:
        base = quiver.get(f"base-c{scenario.concurrency}")
        if base and "error" not in base:  # quiver itself serving the base model at the same concurrency
            row["ratios"][f"quiver/quiver_base-c{scenario.concurrency}"] = _ratio(
                q["throughput_tok_s"], base["throughput_tok_s"])
    step = row["decode_step"]["quiver_inter_token_p50_s"]
    if step:
        row["decode_step"]["floor/quiver"] = round(floor / step, 3)
    return row


def multi_lora_summary(rows: list[dict]) -> dict | None:
    """Issue 3's two targets, read off the adapter scenario with the most adapters."""
    adapter_rows = [r for r in rows if r["adapters"]]
    if not adapter_rows:
        return None
    row = max(adapter_rows, key=lambda r: r["adapters"])
    c = row["concurrency"]
    vs_base = row["ratios"].get(f"quiver/quiver_base-c{c}")
    vs_naive = row["ratios"].get("quiver/peft_one_at_a_time")
    naive = row["baselines"].get("peft_one_at_a_time", {})
    summary = {
        "scenario": row["scenario"],
        "vs_base_only": {"ratio": vs_base, "target": TARGET_VS_BASE,
                         "met": None if vs_base is None else vs_base >= TARGET_VS_BASE,
                         "base_scenario": f"base-c{c}"},
        "vs_naive_peft": {"ratio": vs_naive, "target": TARGET_VS_NAIVE,
                          "met": None if vs_naive is None else vs_naive >= TARGET_VS_NAIVE,
                          "naive_requests_timed": naive.get("requests_timed"),
                          "naive_requests_in_scenario": naive.get("requests_in_scenario")},
        "naive_agreement_with_quiver": naive.get("agreement_with_quiver"),
    }
    if "error" in row["quiver"]:
        summary["quiver_error"] = row["quiver"]["error"]
    return summary


def logprobs_summary(rows: list[dict]) -> dict | None:
    """Issue 13's target: streams asking for top-k logprobs against the same streams without."""
    row = next((r for r in rows if r.get("logprobs")), None)
    if row is None:
        return None
    ratio = row["ratios"].get(f"quiver/quiver_base-c{row['concurrency']}")
    return {"scenario": row["scenario"], "vs_base_only": ratio, "target": TARGET_LOGPROBS_VS_BASE,
            "met": None if ratio is None else ratio >= TARGET_LOGPROBS_VS_BASE,
            "base_scenario": f"base-c{row['concurrency']}"}


def structured_output_summary(model: str, mixed: dict | None, stall: dict | None) -> dict:
    """Issue 14's block: the mixed run against the all-free one, the compile stall, and the
    per-step mask cost (read off /metrics around the mixed runs). A scenario that failed is
    {"error": ...} and the other one is still reported."""
    block: dict = {"model": model}
    if mixed is not None:
        if "error" in mixed:
            block["throughput"] = mixed
        else:
            ratio, steady, matched = mixed["ratio"], mixed["steady_ratio"], mixed["ratio_matched_lengths"]
            block["throughput"] = {
                "ratio": ratio, "target": TARGET_STRUCTURED_VS_FREE, "met": ratio >= TARGET_STRUCTURED_VS_FREE,
                # While every stream is busy (the whole-run rate also charges the grammar for the
                # emptier tail left when the shorter constrained outputs end first).
                "steady_ratio": steady, "met_steady": None if steady is None else steady >= TARGET_STRUCTURED_VS_FREE,
                # Against the all-free run given the mixed run's output lengths (same arrivals).
                "ratio_matched_lengths": matched,
                "met_matched_lengths": None if matched is None else matched >= TARGET_STRUCTURED_VS_FREE,
                "mean_completion_tokens": {
                    "constrained": mixed["mixed"]["constrained"]["mean_completion_tokens"],
                    "free": mixed["mixed"]["free"]["mean_completion_tokens"]},
                **{k: v for k, v in mixed.items()
                   if k not in ("ratio", "steady_ratio", "ratio_matched_lengths", "mask_cost")},
            }
            block["mask_cost"] = mixed["mask_cost"]
    if stall is not None:
        ratio, vs_control = stall.get("p99_ratio"), stall.get("during_p99_vs_control")
        block["compile_stall"] = stall if "error" in stall else {
            **stall, "target": TARGET_STALL_P99, "met": None if ratio is None else ratio <= TARGET_STALL_P99,
            "met_vs_control": None if vs_control is None else vs_control <= TARGET_STALL_P99}
    return block


def build_report(args, shape, scenarios, quiver: dict, baselines: dict[str, dict]) -> dict:
    rows = [build_row(args, shape, scenario, quiver, baselines) for scenario in scenarios]
    report = {
        "benchmark": "quiver-bench/v2",
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
                     "ignore_eos": True,
                     "client": "raw HTTP/1.1 SSE (bench/fixtures/sse_client.py), streaming /v1/completions"},
        "baselines": {
            "transformers_generate": "transformers' batched generate on the base model, one static "
                                     "batch of `concurrency` prompts; best of `repeats`",
        },
        "scenarios": rows,
    }
    if any(s.adapters for s in scenarios):
        report["adapters"] = {
            "ranks": list(adapters.RANKS), "rank_rule": "adapter i has rank RANKS[i % 2]",
            "target_modules": adapters.TARGET_MODULES, "weights": "random (lora_A and lora_B)",
            "source": "local adapter root, PEFT save_pretrained files",
            "server_flags": adapters.server_flags(Path("ROOT"), args.max_active_adapters),
            "request_rule": "request i goes to adapter i % n (with 32 streams, stream j keeps one adapter)",
            "warm_up": "one short request per adapter before timing: adapters are loaded (and in "
                       "device slots, when they fit) when the timed run starts",
        }
        report["baselines"]["peft_one_at_a_time"] = (
            "transformers + peft, every adapter loaded into one PeftModel (load_adapter), requests "
            "served one at a time: set_adapter, then generate; total tokens / total wall time. "
            f"Timed on the first {args.naive_requests or 'all'} requests of each adapter scenario "
            "(in the scenario's order, so adapters switch as in the scenario): one request at a "
            "time, its rate does not depend on how many requests there are. Best of `repeats`.")
        report["multi_lora"] = multi_lora_summary(rows)
    if any(s.logprobs for s in scenarios):
        report["logprobs"] = logprobs_summary(rows)
    return report
