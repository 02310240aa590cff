"""`make bench`'s tensor-parallel block (issue 29), CPU: one model served with `--num-shard 1` (one
rank on every core) and `--num-shard 2` (two ranks, each pinned to half of the cores, gloo
between them), both up side by side, repeats alternating between them; 1 and 32 streams on the
bench model (float32) and on the real demo model (bfloat16). Also, in-process, the share of a
32-row decode step that rank 0 spends in the all-reduces and the logits' all-gather (torch's
profiler around a few steps of two ranks in processes of their own).

On a host of 2 cores this measures what the split costs, not what it buys: both servers have the
same cores and the same memory bandwidth. What a two-socket server gains (one rank per socket,
each reading half the weights from its own memory) is argued in docs/benchmarks.md."""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.fixtures import bench_model, load, real_prompts
from bench.fixtures.stack import Stack, StackConfig
from bench.fixtures.stats import with_median
from bench.suite import real_model

SERVED = "tp-bench"
SCENARIOS = [("c1", 1), ("c32", 32)]
SHARDS = (1, 2)
PROFILED_STEPS = 8


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _stack(model_dir: Path, dtype: str, shards: int, max_total: int, logs: Path, name: str) -> Stack:
    return Stack(StackConfig(
        model_id=str(model_dir), served_model_name=SERVED, dtype=dtype, device="cpu", cpu_kv_cache_gib=1.0,
        max_total_tokens=max_total, max_batch_size=32,
        extra_args=["--num-shard", str(shards), "--prefix-caching", "false"]), logs / f"quiver-tp-{name}-{shards}.log")


def _models(model_root: Path) -> dict[str, tuple[Path, str, list[list[int]]]]:
    from transformers import AutoTokenizer

    bench_dir = bench_model.ensure_model(bench_model.SHAPES["cpu"], model_root, "cpu")
    demo = real_model.ensure_demo(model_root)
    bench_prompts = [[(7 * i + j) % 30000 + 10 for j in range(128)] for i in range(64)]
    demo_prompts = real_prompts.prompt_ids(AutoTokenizer.from_pretrained(demo), 64)
    return {"bench-model-float32": (bench_dir, "float32", bench_prompts),
            "demo-bfloat16": (demo, "bfloat16", demo_prompts)}


def run(model_root: Path, repeats: int, max_tokens: int, requests_per_client: int, logs: Path) -> dict:
    block: dict[str, Any] = {"shards": list(SHARDS), "max_tokens": max_tokens, "repeats": repeats}
    for name, (model_dir, dtype, prompts) in _models(model_root).items():
        refusal = split_refusal(model_dir, max(SHARDS))
        if refusal is not None:  # the demo's 9 heads and 3 KV heads do not split in two
            log(f"tensor parallel: {name} does not split over {max(SHARDS)} shards: {refusal}")
            block[name] = {"refused": refusal}
            continue
        max_total = max(len(p) for p in prompts) + max_tokens + 16
        stacks = {n: _stack(model_dir, dtype, n, max_total, logs, name) for n in SHARDS}
        runs: dict[int, dict[str, list]] = {n: {s: [] for s, _ in SCENARIOS} for n in SHARDS}
        try:
            for n, stack in stacks.items():
                log(f"tensor parallel: starting {name} on {n} shard(s); log: {stack.log_path}")
                stack.start(timeout_s=300)
            for repeat in range(repeats):
                for n, stack in stacks.items():
                    for scenario, concurrency in SCENARIOS:
                        log(f"tensor parallel, run {repeat + 1}/{repeats}: {name}, {n} shard(s), {scenario}")
                        workload = load.Workload(SERVED, prompts, max_tokens, requests_per_client)
                        runs[n][scenario].append(load.measure(stack.base_url + "/v1", workload, concurrency, 1))
        finally:
            for stack in stacks.values():
                stack.stop()
        block[name] = {f"shards-{n}": {s: with_median(load.best_of(r)[0]) for s, r in runs[n].items()}
                       for n in SHARDS}
        block[name]["collective_share_of_a_decode_step"] = collective_share(model_dir, dtype)
    return block


def split_refusal(model_dir: Path, shards: int) -> str | None:
    """Why the model's shape does not split over `shards` ranks (the shard's own check), if it does not."""
    from quiver_server.models import family_for
    from quiver_server.models.decoder import DecoderForCausalLM
    from quiver_server.models.tensor_split import local_config
    from quiver_server.parallel import TensorParallel
    from quiver_server.weights import load_config

    config = load_config(model_dir)
    family = family_for(config)
    assert issubclass(family, DecoderForCausalLM)
    try:
        local_config(family.config_from_hf(config), TensorParallel(0, shards))
    except ValueError as error:
        return str(error)
    return None


def collective_share(model_dir: Path, dtype: str, rows: int = 32, context: int = 200) -> dict:
    """Rank 0 of 2, in-process: the median decode step of `rows` sequences of `context` tokens,
    and the part of it spent in the collectives (gloo's all-reduce and all-gather)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context_ = mp.get_context("spawn")
    results = context_.SimpleQueue()
    ranks = [context_.Process(target=_profile_rank, args=(rank, 2, port, str(model_dir), dtype, rows, context, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    got = dict(results.get() for _ in ranks)
    for process in ranks:
        process.join()
    return got[0]


def _profile_rank(rank: int, size: int, port: int, model_dir: str, dtype: str, rows: int, context: int,
                  results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.profiler import ProfilerActivity, profile

    from quiver_server.engine.batch_types import RequestSpec
    from quiver_server.engine.engine import Engine
    from quiver_server.parallel import join_group

    tp = join_group(rank, size, torch.device("cpu"))
    engine = Engine(model_dir, SERVED, dtype=dtype, device="cpu", cpu_kv_cache_gib=1.0, tp=tp)
    engine.warmup(2048, 1024, rows)
    per = (context + PROFILED_STEPS * 2 + 16) // 16 + 1
    requests = [RequestSpec(id=i, input_ids=[(7 * i + j) % 30000 + 10 for j in range(context)],
                            blocks=list(range(i * per, (i + 1) * per))) for i in range(rows)]
    for first in range(0, rows, 8):
        engine.prefill(1 + first, requests[first:first + 8])
    batches = [1 + first for first in range(0, rows, 8)]
    engine.decode(batches)  # joins the batches into batch 1
    steps = []
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(PROFILED_STEPS):
            started = time.perf_counter()
            engine.decode([1])
            steps.append(time.perf_counter() - started)
    collective_us = sum(event.cpu_time_total for event in profiler.key_averages()
                        if "allreduce" in event.key or "all_gather" in event.key or "allgather" in event.key)
    step_s = statistics.median(steps)
    results.put((rank, {"rows": rows, "context": context, "step_ms": round(step_s * 1e3, 2),
                        "collectives_ms_per_step": round(collective_us / 1e3 / PROFILED_STEPS, 2),
                        "collective_share": round(collective_us / 1e6 / PROFILED_STEPS / step_s, 3)}))
    torch.distributed.destroy_process_group()
