"""`make bench`'s issue-16 block: quiver against itself with a feature on and off.

- shared prefix (cache_scenarios.SharedPrefix): `--prefix-caching true` against `false`; the
  ratio of TTFT p50 (off / on: above 1 is what the cache saves).
- long prompts arriving (cache_scenarios.LongArrivals): `--chunked-prefill true` against
  `false`; the running streams' inter-token p50/p99 after the arrival, the arrivals' TTFT.

Both stacks of a comparison run side by side and the repeats alternate between them. A launcher
that does not know the flag yet runs both sides without it (the report says so), so the
workloads can be exercised before the features land.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.fixtures import cache_scenarios
from bench.fixtures.stack import LAUNCHER, Stack, StackConfig

SERVED_NAME = "bench"


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def launcher_knows(flag: str) -> bool:
    done = subprocess.run([str(LAUNCHER), "--help"], capture_output=True, text=True)
    return flag in done.stdout


def _config(model_dir: Path, dtype: str, device: str, max_input: int, max_total: int, batch: int,
            extra: list[str]) -> StackConfig:
    return StackConfig(model_id=str(model_dir), served_model_name=SERVED_NAME, dtype=dtype, device=device,
                       cpu_kv_cache_gib=2.0 if device == "cpu" else None, max_input_tokens=max_input + 8,
                       max_total_tokens=max_total + 16, max_batch_size=batch, extra_args=extra)


def _on_off(flag: str, logs: Path, name: str, make_config, measure, repeats: int) -> dict:
    """Runs `measure(base_url, repeat)` on a stack with `flag true` and one with `flag false`,
    alternating; {"true": [runs], "false": [runs], "flag_passed": bool}."""
    passed = launcher_knows(flag)
    stacks = {value: Stack(make_config([flag, value] if passed else []), logs / f"quiver-{name}-{value}.log")
              for value in ("true", "false")}
    runs: dict[str, list] = {"true": [], "false": []}
    try:
        for value, stack in stacks.items():
            log(f"starting quiver {flag} {value if passed else '(flag unknown to this launcher: left out)'}")
            stack.start(timeout_s=600)
        for repeat in range(repeats):
            for value, stack in stacks.items():
                log(f"run {repeat + 1}/{repeats}: {name}, {flag} {value}")
                runs[value].append(measure(stack.base_url + "/v1", repeat))
    finally:
        for stack in stacks.values():
            stack.stop()
    return {"runs": runs, "flag_passed": passed}


def shared_prefix(model_dir: Path, dtype: str, device: str, vocab_size: int, spec: cache_scenarios.SharedPrefix,
                  repeats: int, logs: Path) -> dict:
    prompt = spec.prefix_tokens + spec.suffix_tokens
    result = _on_off(
        "--prefix-caching", logs, "shared-prefix",
        lambda extra: _config(model_dir, dtype, device, prompt, prompt + spec.max_tokens, spec.concurrency, extra),
        lambda url, repeat: cache_scenarios.measure_shared_prefix(url, spec, SERVED_NAME, vocab_size, repeat),
        repeats)
    best = {value: max((r[0] for r in runs), key=lambda f: f["throughput_tok_s"])
            for value, runs in result["runs"].items()}
    on_ttft, off_ttft = best["true"]["ttft_s"]["p50"], best["false"]["ttft_s"]["p50"]
    texts_equal = result["runs"]["true"][0][1] == result["runs"]["false"][0][1]
    return {
        "scenario": spec.name,
        "flag_passed": result["flag_passed"],
        "prefix_caching_true": best["true"],
        "prefix_caching_false": best["false"],
        "ttft_p50_false_over_true": round(off_ttft / on_ttft, 3) if on_ttft else None,
        "target_ttft_ratio": 3.0,
        "outputs_equal": texts_equal,
    }


def long_arrivals(model_dir: Path, dtype: str, device: str, vocab_size: int, spec: cache_scenarios.LongArrivals,
                  repeats: int, logs: Path) -> dict:
    batch = spec.running + spec.arrivals
    result = _on_off(
        "--chunked-prefill", logs, "long-prompts",
        lambda extra: _config(model_dir, dtype, device, max(spec.arrival_prompt_tokens, spec.running_prompt_tokens),
                              spec.max_total_tokens, batch, extra),
        lambda url, repeat: cache_scenarios.measure_long_arrivals(url, spec, SERVED_NAME, vocab_size, repeat),
        repeats)
    best = {value: cache_scenarios.best_of_arrivals(runs)[0] for value, runs in result["runs"].items()}
    return {
        "scenario": spec.name,
        "flag_passed": result["flag_passed"],
        "chunked_prefill_true": best["true"],
        "chunked_prefill_false": best["false"],
        "target_p99_over_p50": 2.0,
        "outputs_equal": result["runs"]["true"][0][1] == result["runs"]["false"][0][1],
    }
