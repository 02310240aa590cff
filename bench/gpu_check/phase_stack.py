"""`make gpu-check` phase `stack` -> parity.json, serve.json (and the launcher's log, stack.log):
the real stack (launcher -> router -> shard) on the model phase's model with its adapters.

- parity: each parity prompt, on the base and on each compared adapter, served greedy (all at
  once, so they share batches) and compared token for token with the model phase's
  transformers/peft reference. A divergence is excused where the reference's top-two logits are
  within the tolerance (DESIGN.md's 1e-4 in float32; in a 16-bit dtype a few of its rounding
  steps of the logit, since reference and server round differently).
- serve: `bench/fixtures/load.py`'s closed-loop streaming clients at each stream count, on the base and over all
  adapters: tokens/s, TTFT and inter-token latency (p50/p99). serve.json is rewritten after each
  scenario, so a run cut short keeps the finished ones.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.fixtures import adapters, bench_model, load
from bench.fixtures.stack import Stack, StackConfig
from bench.gpu_check.common import Options, SERVED_NAME, log, phase_options, write_report

TIE_TOLERANCE_FLOAT32 = 1e-4  # DESIGN.md's correctness rule
# Relative rounding unit of the logits per dtype, for the tie tolerance of 16-bit runs.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
ROUNDINGS = 4


def tie_tolerance(dtype: str, top_logit: float) -> float:
    if dtype not in UNIT_ROUNDOFF:
        return TIE_TOLERANCE_FLOAT32
    return ROUNDINGS * UNIT_ROUNDOFF[dtype] * max(1.0, abs(top_logit))


def compare(served: list[int], reference: dict, dtype: str) -> dict:
    """One prompt's verdict: `exact`, `near-tie` (first divergence where the reference's top two
    were within the tolerance; later tokens are not compared) or `diverged`."""
    want = reference["tokens"]
    position = next((i for i, (a, b) in enumerate(zip(served, want, strict=False)) if a != b), None)
    row: dict[str, Any] = {"served": served, "reference": want,
                           "agreeing_prefix": len(want) if position is None else position}
    if position is None:
        row["verdict"] = "exact" if len(served) == len(want) else "diverged"
        return row
    gap = reference["top2_gaps"][position]
    tolerance = tie_tolerance(dtype, reference["top_logits"][position])
    row |= {"reference_top2_gap": gap, "tolerance": tolerance,
            "verdict": "near-tie" if gap <= tolerance else "diverged"}
    return row


def _complete(stack: Stack, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    status, body = stack.post_json("/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=300)
    if status != 200:
        raise RuntimeError(f"completion for {model} answered {status}: {body}")
    return list(body["choices"][0]["token_ids"])


def parity(stack: Stack, ref: dict, options: Options) -> dict:
    new_tokens = options.profile.parity_new_tokens
    jobs = [(name, index, prompt) for name in ref["reference"] for index, prompt in enumerate(ref["prompts"])]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        served = list(pool.map(lambda job: _complete(stack, SERVED_NAME if job[0] == "base" else job[0], job[2],
                                                      new_tokens), jobs))
    rows = []
    for (name, index, prompt), tokens in zip(jobs, served, strict=True):
        rows.append({"model": name, "prompt_tokens": len(prompt),
                     **compare(tokens, ref["reference"][name][index], ref["dtype"])})
    verdicts = [row["verdict"] for row in rows]
    return {"status": "ok" if "diverged" not in verdicts else "failed", "dtype": ref["dtype"],
            "shape": ref["shape"], "parameters": ref["parameters"], "new_tokens": new_tokens,
            "exact": verdicts.count("exact"), "near_tie": verdicts.count("near-tie"),
            "diverged": verdicts.count("diverged"), "served_in_s": round(time.perf_counter() - started, 2),
            "model_phase_timings": ref["timings"], "rows": rows}


def serve(stack: Stack, ref: dict, options: Options, report: dict) -> None:
    profile = options.profile
    prompts = bench_model.prompts(max(profile.streams), profile.prompt_tokens, ref["vocab_size"])
    adapter_ids = tuple(ref["adapter_ids"])
    for streams in profile.streams:
        for label, names in (("base", ()), (f"{len(adapter_ids)} adapters", adapter_ids)):
            workload = load.Workload(SERVED_NAME, prompts, profile.max_tokens, profile.requests_per_client, names)
            row, _ = load.measure(f"{stack.base_url}/v1", workload, streams)
            row = {"scenario": label, "streams": streams, "prompt_tokens": profile.prompt_tokens,
                   "max_tokens": profile.max_tokens, **row}
            report["scenarios"].append(row)
            log(f"serve {label} at {streams} streams: {row['throughput_tok_s']} tok/s, "
                f"TTFT p50 {row['ttft_s'].get('p50')} s, ITL p50 {row['inter_token_s'].get('p50')} s")
            write_report(options, "serve.json", report)
    base = {r["streams"]: r["throughput_tok_s"] for r in report["scenarios"] if r["scenario"] == "base"}
    report["adapters_over_base"] = {
        str(r["streams"]): round(r["throughput_tok_s"] / base[r["streams"]], 3)
        for r in report["scenarios"] if r["scenario"] != "base" and base.get(r["streams"])}
    report["status"] = "ok"


def stack_config(options: Options, ref: dict) -> StackConfig:
    profile = options.profile
    streams = max(profile.streams)
    flags = adapters.server_flags(Path(ref["adapter_root"]), max_active=len(ref["adapter_ids"]),
                                  max_rank=adapters.largest_rank(Path(ref["adapter_root"]), ref["adapter_ids"]))
    return StackConfig(
        model_id=ref["model_dir"], served_model_name=SERVED_NAME, dtype=ref["dtype"], device=options.device,
        cpu_kv_cache_gib=0.25 if options.device == "cpu" else None,
        max_input_tokens=profile.max_total_tokens // 2, max_total_tokens=profile.max_total_tokens,
        max_batch_size=streams, max_concurrent_requests=4 * streams, extra_args=flags)


def main() -> None:
    options = phase_options()
    # The orchestrator's SIGTERM at the time limit: unwind, so the stack below is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ref = json.loads(options.reference_path.read_text())
    log_path = options.work / "stack.log"
    stack = Stack(stack_config(options, ref), log_path)
    started = time.perf_counter()
    try:
        stack.start(timeout_s=options.profile.stack_start_s)
        (options.work / "stack.pid").write_text(str(stack.process.pid))
        start_s = round(time.perf_counter() - started, 2)
        log(f"stack healthy in {start_s} s")
        result = parity(stack, ref, options)
        result["stack_start_s"] = start_s
        write_report(options, "parity.json", result)
        log(f"parity: {result['exact']} exact, {result['near_tie']} near-tie, {result['diverged']} diverged")
        report: dict[str, Any] = {"status": "partial", "shape": ref["shape"], "dtype": ref["dtype"],
                                  "stack_start_s": start_s, "scenarios": []}
        serve(stack, ref, options, report)
        write_report(options, "serve.json", report)
    finally:
        stack.stop()
        if log_path.exists():
            write_report(options, "stack.log", log_tail(log_path))


def log_tail(path: Path, limit: int = 1 << 20) -> str:
    """The end of the launcher's log (the start and the last lines matter; a long run's middle
    is request noise)."""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        if size <= limit:
            handle.seek(0)
            return handle.read().decode(errors="replace")
        handle.seek(0)
        head = handle.read(limit // 4)
        handle.seek(size - 3 * limit // 4)
        return (head + b"\n[... log cut ...]\n" + handle.read()).decode(errors="replace")


if __name__ == "__main__":
    main()
