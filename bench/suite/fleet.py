"""`make bench`'s fleet block (issue 31): S-LoRA's scenario, many adapters behind one base, scaled
to a small CPU host.

The bench model is served with the adapters of `adapters.ensure_fleet` (1,000 distinct adapters,
ranks drawn from 4 to 64, all seven projections) behind `--adapter-source local`, 32 device
slots at `--max-lora-rank 64` (or in rank classes: `--fleet-rank-classes`), a host cache of 64
adapters (`--max-cpu-adapters`); the disk
tier is the adapter directory itself. Requests pick their adapter from a power law: the
adapter of popularity rank k (a seeded shuffle of the fleet) is drawn with weight 1 / k^s. The
same seeded sequence of requests is sent in every run, by `clients` closed-loop streaming
clients that take the next request from the sequence when their last one ends (fixed token-id
prompts, a fixed output length, ignore_eos).

Each repeat starts a fresh stack (no adapter loaded, empty slots and host cache: "cold" means
the same in every repeat) and runs two loads on it, in alternating order from one repeat to the
next: the fleet load, and the same requests on the base model. Beside both, `long_streams`
base-model streams of `long_stream_tokens` tokens run from before the load starts until it ends
(a stream that ends is replaced; the ones still running are cut when the load ends); their
inter-token gaps inside the load's window show what loading adapters does to running streams.

Reported, as the median of the repeats with every repeat listed:
  - output tokens/s of the clients, fleet against base, and the ratio (target >= 0.7);
  - time to first token of cold requests (the first request of an adapter in the run: it reads
    the adapter from disk and copies it into a slot) and warm ones (every later request of an
    adapter that had one before), p50 and p99, and the ratio of the p99s;
  - per long stream, its inter-token gap p50 and max, and the worst max/p50 (target <= 2);
  - from /metrics around the fleet load: adapters loaded into host memory, slot activations and
    evictions, host-cache hits and misses (reads from disk again), and their mean times.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.fixtures import adapters, bench_model, load
from bench.fixtures.sse_client import SseConnection
from bench.fixtures.stack import Stack, StackConfig
from bench.fixtures.stats import percentiles

SERVED = "fleet-bench"
TARGET_THROUGHPUT_VS_BASE = 0.7
TARGET_GAP_MAX_OVER_P50 = 2.0


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class FleetSpec:
    adapters: int = 1000
    zipf_exponent: float = 1.1
    clients: int = 16
    requests: int = 400  # per run, the same sequence in every run
    prompt_tokens: int = 16
    max_tokens: int = 16
    long_streams: int = 4
    long_stream_tokens: int = 256
    max_active_adapters: int = 32
    max_cpu_adapters: int = 64
    max_lora_rank: int = 64
    # --lora-rank-classes; "" (every slot at max_lora_rank) by default: on this CPU block slot
    # memory is no constraint, and classes cost a few percent of step time (one kernel call per
    # class). "8:12,16:6,32:7" sizes the slots to the fleet's mix (docs/benchmarks.md).
    lora_rank_classes: str = ""
    adapter_dtype: str = "bfloat16"  # on disk: half the files of float32; the shard converts
    seed: int = 31

    def request_adapters(self, ids: list[str]) -> list[str]:
        """The adapter of every request, in sending order: Zipf over a seeded shuffle of `ids`."""
        draw = random.Random(self.seed)
        by_popularity = ids[:]
        draw.shuffle(by_popularity)
        weights = [1 / (rank + 1) ** self.zipf_exponent for rank in range(len(by_popularity))]
        return draw.choices(by_popularity, weights=weights, k=self.requests)


@dataclass
class _Request:
    adapter: str
    cold: bool
    timing: load.StreamTiming


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}


async def _read(conn: SseConnection, body: dict, timing: load.StreamTiming) -> None:
    """Streams one completion, appending each token's arrival to `timing` as it comes (a stream
    cut part-way keeps the times it had)."""
    async for chunk in conn.post_stream("/completions", body):
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            timing.token_times.append(time.perf_counter())
    timing.completion_tokens = len(timing.token_times)
    if timing.completion_tokens != body["max_tokens"]:
        raise RuntimeError(f"stream ended after {timing.completion_tokens} of {body['max_tokens']} tokens")


async def _long_streams(conn: SseConnection, prompt: list[int], tokens: int, done: asyncio.Event,
                        out: list[load.StreamTiming]) -> None:
    while not done.is_set():
        out.append(load.StreamTiming(time.perf_counter()))
        await _read(conn, _body(SERVED, prompt, tokens), out[-1])


async def _run(base_url: str, models: list[str], prompts: list[list[int]], long_prompts: list[list[int]],
               spec: FleetSpec) -> dict:
    """One load: `models[i]` is request i's model (an adapter id or the base's name)."""
    conns = [SseConnection(base_url) for _ in range(spec.clients + spec.long_streams)]
    long_conns = conns[spec.clients:]
    try:
        # Connections and first-call paths, on the base model: no adapter is touched before timing.
        await asyncio.gather(*(_read(conn, _body(SERVED, prompts[0], 2), load.StreamTiming(0.0)) for conn in conns))
        done = asyncio.Event()
        long_runs: list[list[load.StreamTiming]] = [[] for _ in long_conns]
        long_tasks = [asyncio.create_task(_long_streams(conn, prompt, spec.long_stream_tokens, done, runs))
                      for conn, prompt, runs in zip(long_conns, long_prompts, long_runs, strict=True)]
        # The load starts once every long stream has its first token (they are decoding by then).
        while not all(runs and runs[0].token_times for runs in long_runs):
            failed = next((task for task in long_tasks if task.done()), None)
            if failed is not None:
                done.set()
                await failed  # raises what ended it
            await asyncio.sleep(0.005)
        sequence = iter(range(len(models)))
        seen: set[str] = set()
        requests: list[_Request] = []

        async def client(conn: SseConnection) -> None:
            for index in sequence:
                model = models[index]
                request = _Request(model, model != SERVED and model not in seen,
                                   load.StreamTiming(time.perf_counter()))
                seen.add(model)
                requests.append(request)
                await _read(conn, _body(model, prompts[index % len(prompts)], spec.max_tokens), request.timing)

        started = time.perf_counter()
        try:
            await asyncio.gather(*(client(conn) for conn in conns[:spec.clients]))
        finally:
            ended = time.perf_counter()
            done.set()
            for task in long_tasks:
                task.cancel()
            await asyncio.gather(*long_tasks, return_exceptions=True)
    finally:
        await asyncio.gather(*(conn.close() for conn in conns))
    tokens = sum(r.timing.completion_tokens for r in requests)
    return {
        "requests": len(requests),
        "generated_tokens": tokens,
        "wall_s": round(ended - started, 3),
        "throughput_tok_s": round(tokens / (ended - started), 2),
        "ttft_s": percentiles([r.timing.ttft for r in requests]),
        "ttft_cold_s": percentiles([r.timing.ttft for r in requests if r.cold]),
        "ttft_warm_s": percentiles([r.timing.ttft for r in requests if not r.cold and r.adapter != SERVED]),
        "distinct_adapters": len({r.adapter for r in requests} - {SERVED}),
        "long_streams": _long_stream_gaps(long_runs, started, ended),
    }


def _long_stream_gaps(runs: list[list[load.StreamTiming]], started: float, ended: float) -> dict:
    """Each long stream's gaps that end inside the load's window [started, ended]."""
    streams = []
    for client, client_runs in enumerate(runs):
        for stream in client_runs:
            gaps = [b - a for a, b in zip(stream.token_times, stream.token_times[1:], strict=False)
                    if started < b <= ended]
            if len(gaps) < 8:  # a stream cut right after it began: its p50 means little
                continue
            p50 = statistics.median(gaps)
            longest = max(range(len(gaps)), key=gaps.__getitem__)
            ends = [b for b in stream.token_times[1:] if started < b <= ended]
            streams.append({"client": client, "gaps": len(gaps), "p50_ms": round(p50 * 1e3, 2),
                            "max_ms": round(gaps[longest] * 1e3, 2), "max_over_p50": round(gaps[longest] / p50, 2),
                            # when the longest gap ended, in seconds after the load started
                            "max_at_s": round(ends[longest] - started, 2),
                            "gaps_over_2x_p50": sum(g > 2 * p50 for g in gaps)})
    worst = max((s["max_over_p50"] for s in streams), default=None)
    return {"worst_max_over_p50": worst,
            "p50_ms": round(statistics.median(s["p50_ms"] for s in streams), 2) if streams else None,
            "gaps_over_2x_p50": sum(s["gaps_over_2x_p50"] for s in streams),
            "gaps": sum(s["gaps"] for s in streams), "streams": streams}


ADAPTER_SERIES = {
    "activations": "quiver_adapter_activations_total{",
    "evictions": "quiver_adapter_evictions_total{",
    "host_loads": "quiver_adapter_load_seconds_count",
    "host_load_seconds": "quiver_adapter_load_seconds_sum",
    "activation_seconds": "quiver_adapter_activation_seconds_sum",
    "host_cache_hits": "quiver_adapter_host_cache_hits_total",
    "host_cache_misses": "quiver_adapter_host_cache_misses_total",
}


def _adapter_counters(stack: Stack) -> dict[str, float]:
    """The adapter counters of /metrics, each summed over its labels."""
    metrics = stack.metrics()
    return {key: sum(v for name, v in metrics.items() if name == series or name.startswith(series))
            for key, series in ADAPTER_SERIES.items()}


def _adapter_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {key: after[key] - before[key] for key in before}
    loads, activations = delta.pop("host_loads"), delta["activations"]
    load_s, activation_s = delta.pop("host_load_seconds"), delta.pop("activation_seconds")
    return {"adapters_loaded": int(loads), **{k: int(v) for k, v in delta.items()},
            "mean_host_load_ms": round(load_s / loads * 1e3, 2) if loads else None,
            "mean_activation_ms": round(activation_s / activations * 1e3, 2) if activations else None}


def _server_flags(root: Path, spec: FleetSpec) -> list[str]:
    classes = ["--lora-rank-classes", spec.lora_rank_classes] if spec.lora_rank_classes else []
    return [*adapters.server_flags(root, spec.max_active_adapters, spec.max_lora_rank), *classes,
            "--max-cpu-adapters", str(spec.max_cpu_adapters), "--prefix-caching", "false"]


def _stack(model_dir: Path, dtype: str, root: Path, spec: FleetSpec, logs: Path, repeat: int) -> Stack:
    return Stack(StackConfig(
        model_id=str(model_dir), served_model_name=SERVED, dtype=dtype, device="cpu", cpu_kv_cache_gib=1.0,
        max_input_tokens=spec.prompt_tokens + 8, max_total_tokens=spec.prompt_tokens + spec.long_stream_tokens + 16,
        max_batch_size=spec.clients + spec.long_streams, extra_args=_server_flags(root, spec)),
        logs / f"quiver-fleet-{repeat}.log")


def _slot_memory_mib(log_path: Path) -> float | None:
    """The adapter slots' memory, as the shard logged it at warmup ("adapter slots: … (X MiB)")."""
    found = re.findall(r"adapter slots: [^(]*\(([0-9.]+) MiB\)", log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


def _median(runs: list[dict], path: tuple[str, ...]) -> float | None:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            values.append(value)
    return round(statistics.median(values), 6) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(model_root: Path, shape: bench_model.Shape, repeats: int, spec: FleetSpec, logs: Path) -> dict:
    model_dir = bench_model.ensure_model(shape, model_root, "cpu")
    root = model_root / f"{shape.name}-fleet"
    log(f"fleet: {spec.adapters} adapters under {root}")
    ids = adapters.ensure_fleet(model_dir, root, spec.adapters, spec.adapter_dtype)
    fleet_models = spec.request_adapters(ids)
    loads = {"fleet": fleet_models, "base": [SERVED] * len(fleet_models)}
    prompts = bench_model.prompts(spec.requests, spec.prompt_tokens, shape.vocab_size, seed=spec.seed)
    long_prompts = bench_model.prompts(spec.long_streams, spec.prompt_tokens, shape.vocab_size, seed=spec.seed + 1)
    runs: dict[str, list[dict]] = {"fleet": [], "base": []}
    slot_memory: float | None = None
    for repeat in range(repeats):
        stack = _stack(model_dir, shape.dtype, root, spec, logs, repeat)
        log(f"fleet, run {repeat + 1}/{repeats}: starting a fresh stack; log: {stack.log_path}")
        stack.start(timeout_s=300)
        try:
            order = ["base", "fleet"] if repeat % 2 == 0 else ["fleet", "base"]
            for name in order:
                log(f"fleet, run {repeat + 1}/{repeats}: {name}, {spec.clients} clients, {spec.requests} requests")
                before = _adapter_counters(stack)
                result = asyncio.run(_run(stack.base_url + "/v1", loads[name], prompts, long_prompts, spec))
                if name == "fleet":
                    result["adapter_metrics"] = _adapter_metrics(before, _adapter_counters(stack))
                runs[name].append({"repeat": repeat, "order": order.index(name), **result})
        finally:
            stack.stop()
        slot_memory = _slot_memory_mib(stack.log_path)
    popularity = Counter(fleet_models)
    fleet_tput = _median(runs["fleet"], ("throughput_tok_s",))
    base_tput = _median(runs["base"], ("throughput_tok_s",))
    # Each repeat's fleet run against the base run on the same stack, minutes apart at most: on a
    # shared host the speed drifts between repeats by more than the two runs differ.
    paired = [_ratio(f["throughput_tok_s"], b["throughput_tok_s"]) for f, b in zip(runs["fleet"], runs["base"],
                                                                                   strict=True)]
    ratio = round(statistics.median(r for r in paired if r is not None), 3) if paired else None
    cold_p99 = _median(runs["fleet"], ("ttft_cold_s", "p99"))
    warm_p99 = _median(runs["fleet"], ("ttft_warm_s", "p99"))
    worst_gap = _median(runs["fleet"], ("long_streams", "worst_max_over_p50"))
    return {
        "scenario": {
            **asdict(spec), "model": f"{shape.name} ({shape.dtype}, random weights)",
            "ranks": dict(sorted(Counter(adapters.fleet_ranks(spec.adapters)).items())),
            "server_flags": _server_flags(Path("ROOT"), spec),
            "distinct_adapters_requested": len(popularity),
            "top_adapter_share": round(popularity.most_common(1)[0][1] / spec.requests, 3),
            "adapters_requested_once": sum(1 for n in popularity.values() if n == 1),
            "cold": "the first request of an adapter in the run (each repeat starts a fresh stack)",
            "throughput": "output tokens of the clients over the time from their first request to their last "
                          "token (the long streams' tokens are not counted; they run in both loads)",
        },
        "repeats": repeats,
        "adapter_slot_memory_mib": slot_memory,
        "throughput_tok_s": {"fleet": fleet_tput, "base": base_tput},
        "throughput_fleet_over_base": ratio,
        "throughput_fleet_over_base_per_repeat": paired,
        "throughput_target": TARGET_THROUGHPUT_VS_BASE,
        "throughput_met": None if ratio is None else ratio >= TARGET_THROUGHPUT_VS_BASE,
        "ttft_s": {
            "cold": {"p50": _median(runs["fleet"], ("ttft_cold_s", "p50")), "p99": cold_p99},
            "warm": {"p50": _median(runs["fleet"], ("ttft_warm_s", "p50")), "p99": warm_p99},
            "base": {"p50": _median(runs["base"], ("ttft_s", "p50")), "p99": _median(runs["base"], ("ttft_s", "p99"))},
            "p99_cold_over_warm": _ratio(cold_p99, warm_p99),
        },
        "long_stream_gaps": {
            "worst_max_over_p50": {"fleet": worst_gap,
                                   "base": _median(runs["base"], ("long_streams", "worst_max_over_p50"))},
            "p50_ms": {name: _median(runs[name], ("long_streams", "p50_ms")) for name in ("fleet", "base")},
            "share_over_2x_p50": {name: round(statistics.median(
                r["long_streams"]["gaps_over_2x_p50"] / r["long_streams"]["gaps"] for r in runs[name]), 3)
                for name in ("fleet", "base")} if repeats else {},
            "target": TARGET_GAP_MAX_OVER_P50,
            "met": None if worst_gap is None else worst_gap <= TARGET_GAP_MAX_OVER_P50,
        },
        "adapter_metrics": {key: _median(runs["fleet"], ("adapter_metrics", key))
                            for key in runs["fleet"][0]["adapter_metrics"]} if runs["fleet"] else {},
        "runs": runs,
    }
