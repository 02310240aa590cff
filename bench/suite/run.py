"""`make bench`: quiver end to end against transformers on the same random-weight Llama.

Starts the real stack (launcher → shard + router) on a free port, drives it with 1, 8 and 32
concurrent streaming clients on the base model, then with 32 streams spread over 1, 8 and 32
distinct LoRA adapters (ranks 8 and 16, random weights, local adapter root), all with
fixed-length token-id prompts and a fixed output length (ignore_eos). Between quiver's runs it
times `transformers`' batched `generate` for the base scenarios on the same weights in this
process (repeats alternate, so both sides share the machine's slow and fast periods). Then it
stops the stack and runs `transformers` + `peft` serving the adapter scenarios' requests one at
a time with `set_adapter` (on the first --naive-requests requests of each; see
peft_baseline.py). Prints ONE JSON report (report.py) on stdout and writes it to bench/results/;
progress goes to stderr.

Scenarios are data (`Scenario`): base scenarios have no adapters, adapter scenarios name the
adapter ids their requests cycle through.

The structured-output measurements (issue 14, structured.py) run last, on a second stack that
serves the same weights with a tokenizer that can spell JSON (bench/fixtures/json_model.py): 32 streams, half
under a JSON schema, against the same streams all free; the stall of 8 new schemas on 16 free
streams; the per-step mask cost from /metrics. They make the report's `structured_output` block;
`--structured-concurrency 0 --stall-streams 0` leaves them out.

Issue 16's workloads (cache.py) follow on stacks of their own: a shared 1,024-token system
prefix over 32 streams with `--prefix-caching true` against `false`, and 4 prompts of 2,048
tokens arriving while 28 streams decode with `--chunked-prefill true` against `false`; they make
the report's `prefix_caching` and `chunked_prefill` blocks (`--shared-prefix-concurrency 0` and
`--long-running 0` leave them out).

The real-model block (real_model.py) runs the demo model, SmolLM2-135M-Instruct with its pirate
adapter, in float32 and bfloat16 on chat prompts of realistic lengths, against transformers'
generate in the same dtype, with greedy agreement against transformers in float32
(`--real-model-repeats 0` leaves it out).

The model-family block (families.py, issue 25) runs a Qwen3-MoE-shaped and a Gemma-3-shaped
random model (bench/fixtures/family_shapes.py), each on a stack of its own: 8 streams on the base against
transformers' batched generate (repeats alternating), the same 8 streams over 8 LoRA adapters
(router and experts included on the MoE) against transformers+peft one request at a time, and
greedy agreement with both; it makes the report's `model_families` block (`--families-repeats 0`
leaves it out).

The quantization block (quant.py, issue 28) serves the demo model in float32, bfloat16,
with `--quantize int8`/`int4` (float32 and bfloat16 activations) and over an fp8 KV cache
(`--kv-cache-dtype fp8`) side by side: 1, 8 and 32 streams
on the base, 32 on the adapter, the perplexity of testdata/perplexity/ from each server's own
prompt logprobs, and greedy agreement with bfloat16 (`--quant-repeats 0` leaves it out).

The embeddings block (embeddings.py, issue 30) runs `/v1/embeddings` on the bench model
alone, chat streams alone, and both at once: embedding throughput beside chat against alone, and
the chat streams' inter-token p99 beside embeddings against alone (`--embed-repeats 0` leaves it
out).

The step-breakdown block (step_breakdown.py, issue 50; CPU only) runs the demo model in-process
on the shard's Engine in float32, bfloat16, int8 and int4: 1, 8 and 32 streams decoding on the
base and on the adapter, and prefill chunks of 256 and 1,024 tokens, each step split into
projections, LoRA, attention, small ops, LM head, sampling and host time, with the bytes it moves
against the measured stream bandwidth (the byte floor; `--step-breakdown-repeats 0` leaves it
out).

The tensor-parallel block (tensor_parallel.py, issue 29) serves the bench model and the demo with
`--num-shard 1` and `--num-shard 2` side by side (1 and 32 streams) and measures the collectives'
share of a decode step on rank 0 (`--tp-repeats 0` leaves it out).

The fleet block (fleet.py, issue 31; CPU only) serves the bench model with 1,000 adapters of
ranks 4 to 64 (32 device slots, a host cache of 64, the rest read from disk again), sends requests
whose adapters follow a Zipf popularity from 16 streaming clients on a fresh stack per repeat, and
the same requests on the base model, repeats alternating: throughput against the base, the TTFT of
cold (first use) against warm requests, and the inter-token gaps of 4 long base-model streams
running throughout, with the adapter counters of /metrics (`--fleet-repeats 0` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.fixtures import adapters, bench_model, cache_scenarios, json_model, load
from bench.fixtures.paths import REPO_ROOT, RESULTS_DIR
from bench.fixtures.stack import Stack, StackConfig
from bench.suite import hf_baseline, peft_baseline, real_model, structured
from bench.suite import cache as cache_bench
from bench.suite import embeddings as embeddings_bench
from bench.suite import families as families_bench
from bench.suite import fleet as fleet_bench
from bench.suite import quant as quant_bench
from bench.suite import step_breakdown
from bench.suite import report as reports
from bench.suite import tensor_parallel as tp_bench

SERVED_NAME = "bench"
# Alternatives per token in the logprobs scenario (issue 13: 32 streams with top-5 logprobs).
LOGPROBS = 5


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    adapters: tuple[str, ...] = ()  # adapter ids the requests cycle through; () = base model
    logprobs: int = 0  # alternatives per token the requests ask for (completions' `logprobs`)

    def workload(self, prompts, max_tokens: int, requests_per_client: int) -> load.Workload:
        return load.Workload(SERVED_NAME, prompts, max_tokens, requests_per_client, self.adapters,
                             self.logprobs)

    @property
    def base_only(self) -> bool:
        """A plain base-model scenario, the kind transformers' generate is timed against."""
        return not self.adapters and not self.logprobs


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="picks the model shape too: ~58M params on cpu, Llama-2-7B's on cuda")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model, short outputs, one request per client")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts (base model)")
    p.add_argument("--adapters", default="1,8,32",
                   help="comma-separated counts of distinct adapters for the adapter scenarios ('' for none)")
    p.add_argument("--adapter-concurrency", type=int, default=32, help="streams in every adapter scenario")
    p.add_argument("--naive-requests", type=int, default=8,
                   help="requests of each adapter scenario the transformers+peft baseline serves, "
                        "one at a time (0: all of them)")
    p.add_argument("--logprobs-concurrency", type=int, default=32,
                   help="streams of the logprobs scenario (base model, `logprobs: 5`); 0: no such scenario")
    p.add_argument("--structured-concurrency", type=int, default=32,
                   help="streams of the structured-output scenario (every other one under a JSON schema, "
                        "against the same streams all free); 0: no such scenario")
    p.add_argument("--structured-adapters", type=int, default=8,
                   help="adapters the structured-output streams spread over, one schema each (0: base model)")
    p.add_argument("--stall-streams", type=int, default=16,
                   help="free streams of the compile-stall measurement; 0: no such measurement")
    p.add_argument("--stall-arrivals", type=int, default=8,
                   help="requests with never-seen schemas arriving while the free streams run")
    p.add_argument("--stall-prompt-tokens", type=int, default=16,
                   help="prompt length of the arriving requests (short: the window measures their "
                        "compiles more than their prefill; a control run without schemas shows the latter)")
    p.add_argument("--stall-window-tokens", type=int, default=16,
                   help="tokens of each free stream in the window before the arrivals")
    p.add_argument("--stall-stream-tokens", type=int, default=512,
                   help="max_tokens of the compile-stall free streams (cut once the window closes)")
    p.add_argument("--shared-prefix-concurrency", type=int, default=32,
                   help="streams of the shared-prefix scenario (prefix caching on against off); 0: none")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="the shared system prefix of those prompts")
    p.add_argument("--suffix-tokens", type=int, default=64, help="the distinct suffix of each of them")
    p.add_argument("--long-running", type=int, default=28,
                   help="streams decoding when the long prompts arrive (chunked prefill on against off); 0: none")
    p.add_argument("--long-running-tokens", type=int, default=256, help="max_tokens of those streams")
    p.add_argument("--long-arrivals", type=int, default=4, help="long prompts arriving")
    p.add_argument("--long-prompt-tokens", type=int, default=2048, help="length of each long prompt")
    p.add_argument("--real-model-repeats", type=int, default=3,
                   help="alternating repeats of the real-model block (the demo model in float32 and "
                        "bfloat16, real_model.py); 0: no such block")
    p.add_argument("--real-model-max-tokens", type=int, default=64, help="tokens per request of that block")
    p.add_argument("--families-repeats", type=int, default=3,
                   help="alternating repeats of the model-family block (Qwen3-MoE- and Gemma-3-shaped random "
                        "models, base and 8 adapters, families.py); 0: no such block")
    p.add_argument("--quant-repeats", type=int, default=3,
                   help="alternating repeats of the quantization block (the demo model in float32, bfloat16, "
                        "int8 and int4, with perplexity, quant.py; CPU only); 0: no such block")
    p.add_argument("--step-breakdown-repeats", type=int, default=2,
                   help="rounds of (timed, plain) decode steps per configuration of the step breakdown (the demo "
                        "model's decode steps and prefill chunks split into components against the byte floor, "
                        "step_breakdown.py; CPU only); 0: no such block")
    p.add_argument("--step-breakdown-dtypes", default=step_breakdown.DTYPES,
                   help="settings of the step breakdown (float32, bfloat16, int8, int4, bfloat16-int8, ...)")
    p.add_argument("--step-breakdown-streams", default="1,8,32", help="decode stream counts of the step breakdown")
    p.add_argument("--step-breakdown-prefill-chunks", default="256,1024",
                   help="prefill lengths the step breakdown times ('' for none)")
    p.add_argument("--tp-repeats", type=int, default=3,
                   help="repeats of the tensor-parallel block (--num-shard 1 against 2, tensor_parallel.py; CPU only); "
                        "0: no such block")
    p.add_argument("--embed-repeats", type=int, default=3,
                   help="alternating repeats of the embeddings block (embeddings.py); 0: no such block")
    p.add_argument("--embed-clients", type=int, default=4, help="closed-loop embedding clients")
    p.add_argument("--embed-batch", type=int, default=16, help="inputs per embedding request")
    p.add_argument("--embed-input-tokens", type=int, default=128, help="tokens per embedding input")
    p.add_argument("--embed-requests", type=int, default=4, help="requests per embedding client when alone")
    p.add_argument("--embed-chat-streams", type=int, default=16, help="chat streams beside the embeddings")
    p.add_argument("--fleet-repeats", type=int, default=3,
                   help="repeats of the fleet block (1,000 adapters, Zipf popularity, against the base; a fresh "
                        "stack each, fleet.py; CPU only); 0: no such block")
    p.add_argument("--fleet-adapters", type=int, default=fleet_bench.FleetSpec.adapters,
                   help="distinct adapters of the fleet block")
    p.add_argument("--fleet-requests", type=int, default=fleet_bench.FleetSpec.requests,
                   help="requests per run of the fleet block (the same seeded sequence in every run)")
    p.add_argument("--fleet-clients", type=int, default=fleet_bench.FleetSpec.clients,
                   help="streaming clients of the fleet block")
    p.add_argument("--fleet-rank-classes", default=fleet_bench.FleetSpec.lora_rank_classes,
                   help="--lora-rank-classes of the fleet block's server (default \"\": every slot at rank 64; "
                        "8:12,16:6,32:7 sizes the slots to the fleet's mix of ranks)")
    p.add_argument("--max-active-adapters", type=int, default=32, help="device slots of the server")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per scenario and baseline; the report keeps the fastest of each")
    p.add_argument("--model-root", type=Path, default=REPO_ROOT / ".cache" / "bench-models")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.max_tokens = min(args.max_tokens, 16)
        args.requests_per_client = 1
        args.repeats = 1
        args.stall_window_tokens = min(args.stall_window_tokens, 8)
        args.stall_stream_tokens = min(args.stall_stream_tokens, 256)
        args.long_running_tokens = min(args.long_running_tokens, 64)
        args.real_model_repeats = min(args.real_model_repeats, 1)
        args.real_model_max_tokens = min(args.real_model_max_tokens, 16)
        args.families_repeats = min(args.families_repeats, 1)
        args.quant_repeats = min(args.quant_repeats, 1)
        args.step_breakdown_repeats = min(args.step_breakdown_repeats, 1)
        args.step_breakdown_dtypes = "float32"
        args.step_breakdown_streams = "1,8"
        args.step_breakdown_prefill_chunks = "256"
        args.tp_repeats = min(args.tp_repeats, 1)
        args.embed_repeats = min(args.embed_repeats, 1)
        args.embed_requests = min(args.embed_requests, 1)
        args.fleet_repeats = min(args.fleet_repeats, 1)
        args.fleet_requests = min(args.fleet_requests, 64)
    return args


def run_quiver_and_transformers(model_dir: Path, shape: bench_model.Shape, args, scenarios, prompts,
                                logs: Path, adapter_root: Path | None) -> tuple[dict, dict, dict, float]:
    """Every scenario on one running stack, and transformers' `generate` for the base scenarios,
    their repeats alternating (quiver run 1, generate run 1, quiver run 2, ...): a shared machine
    drifts by tens of percent over minutes, and alternating puts both sides in the same periods.
    Returns ({scenario: quiver measurement}, {scenario: generate measurement}, {scenario:
    {request index: generated text}}, quiver's start-up seconds). A failing adapter scenario is
    recorded as {"error": ...} and the others still run, so a broken adapter path shows in the
    report next to working base figures."""
    log("transformers baseline: loading the same weights (used between quiver's runs)")
    model = hf_baseline.load(str(model_dir), args.device, shape.dtype)
    config = StackConfig(
        model_id=str(model_dir), served_model_name=SERVED_NAME, dtype=shape.dtype, device=args.device,
        cpu_kv_cache_gib=1.0 if args.device == "cpu" else None,
        max_total_tokens=args.prompt_tokens + args.max_tokens + 16,
        max_input_tokens=args.prompt_tokens + 8,
        max_batch_size=max(s.concurrency for s in scenarios),
        # One server for every scenario: base-only rows are measured with adapter slots allocated
        # (a batch without adapter rows skips the LoRA kernels), so the ratio compares requests,
        # not server configurations.
        extra_args=adapters.server_flags(adapter_root, args.max_active_adapters),
    )
    quiver_runs: dict[str, list] = {s.name: [] for s in scenarios}
    generate_runs: dict[str, list] = {s.name: [] for s in scenarios if s.base_only}
    errors: dict[str, dict] = {}
    stack = Stack(config, logs / "quiver.log")
    log(f"starting quiver ({shape.name}, {args.device}); log: {stack.log_path}")
    started = time.monotonic()
    stack.start(timeout_s=900 if args.device == "cuda" else 120)
    startup_s = round(time.monotonic() - started, 2)
    log(f"quiver up in {startup_s} s")
    try:
        for repeat in range(args.repeats):
            for scenario in scenarios:
                if scenario.name in errors:
                    continue
                workload = scenario.workload(prompts, args.max_tokens, args.requests_per_client)
                log(f"run {repeat + 1}/{args.repeats}: quiver {scenario.name}")
                try:
                    quiver_runs[scenario.name].append(
                        load.measure(stack.base_url + "/v1", workload, scenario.concurrency, 1))
                except Exception as err:  # noqa: BLE001 - reported, not hidden
                    if scenario.base_only:
                        raise
                    errors[scenario.name] = {"error": f"{type(err).__name__}: {err}"}
                    log(f"quiver {scenario.name} FAILED: {errors[scenario.name]['error']}")
                if scenario.name in generate_runs:
                    log(f"run {repeat + 1}/{args.repeats}: transformers generate, batch {scenario.concurrency}")
                    generate_runs[scenario.name].append(hf_baseline.measure(
                        model, args.device, prompts, scenario.concurrency, args.max_tokens, repeats=1))
    finally:
        stack.stop()
    del model
    bench_model.release_device_memory()
    quiver, texts = dict(errors), {}
    for name, runs in quiver_runs.items():
        if name not in errors:
            quiver[name], texts[name] = load.best_of(runs)
    generate = {name: hf_baseline.best_of(runs) for name, runs in generate_runs.items()}
    return quiver, generate, texts, startup_s


def run_peft(model_dir: Path, shape: bench_model.Shape, args, scenarios, prompts, adapter_root: Path,
             quiver_texts: dict[str, dict[int, str]]) -> dict:
    adapter_scenarios = [s for s in scenarios if s.adapters]
    if not adapter_scenarios:
        return {}
    ids = sorted({a for s in adapter_scenarios for a in s.adapters})
    log(f"transformers+peft baseline: loading the base and {len(ids)} adapters")
    server = peft_baseline.PeftServer(model_dir, adapter_root, ids, args.device, shape.dtype)
    results = {}
    for scenario in adapter_scenarios:
        workload = scenario.workload(prompts, args.max_tokens, args.requests_per_client)
        requests = workload.first_requests(scenario.concurrency, args.naive_requests)
        total = scenario.concurrency * args.requests_per_client
        log(f"transformers+peft one at a time, {scenario.name}: {len(requests)} of {total} requests")
        results[scenario.name], outputs = server.measure(requests, args.max_tokens, args.repeats, total)
        if scenario.name in quiver_texts:
            results[scenario.name]["agreement_with_quiver"] = peft_baseline.agreement(
                quiver_texts[scenario.name], outputs)
    del server
    bench_model.release_device_memory()
    return results


def cpu_matmul_report(shape: bench_model.Shape, repeats: int) -> dict:
    """bench/kernels/cpu_gemm.py in a process of its own, as the shard's products run: in this one, after
    the baselines' models and threads, its 32-row timings came out up to 30% slower."""
    shape_name = next(name for name, known in bench_model.SHAPES.items() if known == shape)
    done = subprocess.run([sys.executable, "-m", "bench.kernels.cpu_gemm", "--shape", shape_name, "--repeats",
                           str(repeats)], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def run_structured(model_dir: Path, shape: bench_model.Shape, args, prompts, logs: Path,
                   adapter_ids: list[str], adapter_root: Path | None) -> dict:
    """Issue 14's scenarios on a stack of their own: the bench weights with a tokenizer that can
    spell JSON (bench/fixtures/json_model.py; the bench tokenizer's words cannot), so its all-free reference
    runs on that same stack."""
    json_dir = json_model.ensure_json_model(model_dir, shape.vocab_size)
    stream_tokens = max(args.max_tokens, args.stall_stream_tokens if args.stall_streams else 0)
    config = StackConfig(
        model_id=str(json_dir), served_model_name=SERVED_NAME, dtype=shape.dtype, device=args.device,
        cpu_kv_cache_gib=1.0 if args.device == "cpu" else None,
        max_total_tokens=args.prompt_tokens + stream_tokens + 16,
        max_input_tokens=args.prompt_tokens + 8,
        max_batch_size=max(args.structured_concurrency, args.stall_streams + args.stall_arrivals),
        extra_args=adapters.server_flags(adapter_root, args.max_active_adapters),
    )
    setup = structured.Setup(
        model=SERVED_NAME, adapters=tuple(adapter_ids), prompts=prompts, max_tokens=args.max_tokens,
        requests_per_client=args.requests_per_client, concurrency=args.structured_concurrency,
        stall_streams=args.stall_streams, stall_arrivals=args.stall_arrivals,
        stall_window_tokens=args.stall_window_tokens, stall_stream_tokens=args.stall_stream_tokens,
        stall_prompt_tokens=args.stall_prompt_tokens)
    stack = Stack(config, logs / "quiver-structured.log")
    log(f"starting quiver for structured output ({json_dir.name}); log: {stack.log_path}")
    # A shard beside the other stack's teardown on a loaded box can take minutes to load.
    stack.start(timeout_s=900 if args.device == "cuda" else 600)
    mixed = stall = None
    try:
        if args.structured_concurrency:
            log(f"structured output: {args.structured_concurrency} streams, half under a JSON schema, "
                f"against all free ({args.repeats} repeats)")
            try:
                mixed = structured.mixed_vs_free(stack.base_url, setup, args.repeats)
            except Exception as err:  # noqa: BLE001 - reported, not hidden
                mixed = {"error": f"{type(err).__name__}: {err}"}
                log(f"structured output FAILED: {mixed['error']}")
        if args.stall_streams:
            log(f"compile stall: {args.stall_streams} free streams, {args.stall_arrivals} new schemas arrive")
            try:
                stall = structured.compile_stall(stack.base_url, setup, args.repeats, f"n{time.time_ns():x}")
            except Exception as err:  # noqa: BLE001 - reported, not hidden
                stall = {"error": f"{type(err).__name__}: {err}"}
                log(f"compile stall FAILED: {stall['error']}")
    finally:
        stack.stop()
    return reports.structured_output_summary(
        f"{json_dir.name}: the bench weights with a byte-level JSON-capable tokenizer (bench/fixtures/json_model.py)",
        mixed, stall)


def main() -> None:
    args = parse_args()
    shape = bench_model.SHAPES["tiny" if args.quick else args.device]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    adapter_counts = [int(n) for n in args.adapters.split(",") if n.strip() and int(n) > 0]
    # The base-only references of the adapter and logprobs scenarios' ratios.
    for reference in (args.adapter_concurrency if adapter_counts else 0, args.logprobs_concurrency):
        if reference and reference not in concurrencies:
            concurrencies.append(reference)
    scenarios = [Scenario(f"base-c{c}", c) for c in concurrencies]
    if args.logprobs_concurrency:
        c = args.logprobs_concurrency
        scenarios.append(Scenario(f"logprobs{LOGPROBS}-c{c}", c, logprobs=LOGPROBS))
    structured_wanted = bool(args.structured_concurrency or args.stall_streams)
    structured_adapters = args.structured_adapters if args.structured_concurrency else 0
    log(f"model {shape.name} ({shape.parameters() / 1e6:.0f}M params) under {args.model_root}")
    model_dir = bench_model.ensure_model(shape, args.model_root, args.device)
    adapter_root, ids = None, []
    if adapter_counts or structured_adapters:
        adapter_root = args.model_root / f"{shape.name}-adapters"
        count = max(adapter_counts + [structured_adapters])
        log(f"{count} LoRA adapters under {adapter_root}")
        ids = adapters.ensure_adapters(model_dir, adapter_root, count, shape.dtype)
        scenarios += [Scenario(f"lora{n}-c{args.adapter_concurrency}", args.adapter_concurrency,
                               tuple(ids[:n])) for n in adapter_counts]
    count = max([s.concurrency for s in scenarios] + [args.structured_concurrency,
                                                       args.stall_streams + args.stall_arrivals])
    prompts = bench_model.prompts(count * args.requests_per_client, args.prompt_tokens, shape.vocab_size)

    quiver: dict = {}
    generate: dict = {}
    texts: dict = {}
    startup_s = None
    structured_block = None
    with tempfile.TemporaryDirectory(prefix="quiver-bench-") as tmp:
        if scenarios:
            quiver, generate, texts, startup_s = run_quiver_and_transformers(
                model_dir, shape, args, scenarios, prompts, Path(tmp), adapter_root if adapter_counts else None)
        if structured_wanted:
            structured_block = run_structured(model_dir, shape, args, prompts, Path(tmp), ids[:structured_adapters],
                                              adapter_root)
    baselines = {"transformers_generate": generate}
    if adapter_counts and adapter_root is not None:
        baselines["peft_one_at_a_time"] = run_peft(model_dir, shape, args, scenarios, prompts, adapter_root,
                                                  texts)
    report = reports.build_report(args, shape, scenarios, quiver, baselines)
    if startup_s is not None:
        # Launch to the first /health 200: model load, kernels, warm-up, router (no baseline runs
        # beside it; bench-peers times the peers' start-up).
        report["quiver_startup_s"] = startup_s
    if structured_block is not None:
        report["structured_output"] = structured_block
    with tempfile.TemporaryDirectory(prefix="quiver-bench-cache-") as tmp:
        if args.shared_prefix_concurrency:
            spec = cache_scenarios.SharedPrefix(args.shared_prefix_concurrency, args.prefix_tokens, args.suffix_tokens,
                                                args.max_tokens, args.requests_per_client)
            log(f"{spec.name}: --prefix-caching true against false ({args.repeats} repeats)")
            report["prefix_caching"] = cache_bench.shared_prefix(model_dir, shape.dtype, args.device, shape.vocab_size,
                                                                 spec, args.repeats, Path(tmp))
        if args.long_running:
            arrivals = cache_scenarios.LongArrivals(args.long_running, args.prompt_tokens, args.long_running_tokens,
                                                    arrivals=args.long_arrivals,
                                                    arrival_prompt_tokens=args.long_prompt_tokens)
            log(f"{arrivals.name}: --chunked-prefill true against false ({args.repeats} repeats)")
            report["chunked_prefill"] = cache_bench.long_arrivals(model_dir, shape.dtype, args.device, shape.vocab_size,
                                                                  arrivals, args.repeats, Path(tmp))
    if args.embed_repeats:
        log(f"embeddings: alone, beside {args.embed_chat_streams} chat streams ({args.embed_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-embeddings-") as tmp:
            report["embeddings"] = embeddings_bench.run(
                args.model_root, args.device, shape, args.embed_repeats, args.embed_clients, args.embed_batch,
                args.embed_input_tokens, args.embed_requests, args.embed_chat_streams, args.max_tokens,
                args.requests_per_client, Path(tmp))
    if args.real_model_repeats:
        log(f"real model: the demo model in float32 and bfloat16 ({args.real_model_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-real-") as tmp:
            report["real_model"] = real_model.run(args.model_root, args.device, args.real_model_repeats,
                                                  args.real_model_max_tokens, args.requests_per_client, Path(tmp))
    if args.families_repeats:
        log(f"model families: Qwen3-MoE and Gemma 3 shapes, base and {families_bench.ADAPTERS} adapters "
            f"({args.families_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-families-") as tmp:
            report["model_families"] = families_bench.run(
                args.model_root, args.device, "tiny" if args.quick else args.device, args.families_repeats,
                args.prompt_tokens, args.max_tokens, args.requests_per_client, args.naive_requests, Path(tmp))
    if args.quant_repeats and args.device == "cpu":
        log(f"quantization: the demo model in float32, bfloat16, int8 and int4 ({args.quant_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-quant-") as tmp:
            report["quantization"] = quant_bench.run(args.model_root, args.quant_repeats, args.real_model_max_tokens,
                                                     args.requests_per_client, Path(tmp))
    if args.step_breakdown_repeats and args.device == "cpu":
        log(f"step breakdown: the demo model's steps by component, {args.step_breakdown_dtypes}, "
            f"streams {args.step_breakdown_streams}")
        report["step_breakdown"] = step_breakdown.run(
            args.model_root, args.step_breakdown_repeats, args.step_breakdown_dtypes, args.step_breakdown_streams,
            prefill_chunks=args.step_breakdown_prefill_chunks)
    if args.tp_repeats and args.device == "cpu":
        log(f"tensor parallel: --num-shard 1 against 2, bench model and demo ({args.tp_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-tp-") as tmp:
            report["tensor_parallel"] = tp_bench.run(args.model_root, args.tp_repeats, args.real_model_max_tokens,
                                                     args.requests_per_client, Path(tmp))
    if args.fleet_repeats and args.device == "cpu":
        fleet = fleet_bench.FleetSpec(adapters=args.fleet_adapters, requests=args.fleet_requests,
                                      clients=args.fleet_clients, lora_rank_classes=args.fleet_rank_classes)
        log(f"fleet: {fleet.adapters} adapters, Zipf popularity, against the base ({args.fleet_repeats} repeats)")
        with tempfile.TemporaryDirectory(prefix="quiver-bench-fleet-") as tmp:
            report["adapter_fleet"] = fleet_bench.run(args.model_root, shape, args.fleet_repeats, fleet, Path(tmp))
    if args.device == "cpu" and scenarios:
        log("CPU matmuls: quiver's packed kernel, oneDNN's packed sgemm and F.linear, a step's products")
        report["cpu_matmul"] = cpu_matmul_report(shape, repeats=3 if args.quick else 21)

    args.results_dir.mkdir(parents=True, exist_ok=True)
    kind = f"{args.device}-quick" if args.quick else args.device
    path = args.results_dir / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    log(f"report written to {path}")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
