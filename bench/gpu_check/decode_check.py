"""`make gpu-check`, kernels phase: one decode step of the real engine on a small random Llama
with adapters, on the device, as the server runs it, its two adapters (ranks 8 and 16) in two
rank classes (`--lora-rank-classes`: one LoRA kernel call per class, in the graph too):

- the eager forward pass and the CUDA-graph replay under `torch.cuda.set_sync_debug_mode("error")`,
  so any host round trip inside a step (an `.item()`, a `.tolist()`, a `bincount`) is named;
- the replay's logits against the eager pass's on the same inputs (padded rows must not change
  real ones), and the graphs' capture time and memory.
On the CPU (the smoke run) there are no graphs: the entry says so."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from bench.fixtures import adapters, bench_model

from quiver_server.engine.batch_types import RequestSpec, SamplingParams
from quiver_server.engine.engine import Engine
from quiver_server.engine.forward_batch import build_decode, build_lora_meta

ROWS = 5  # not a bucket size: the replay pads to 8


def decode_step_check(work: Path, device: str) -> dict[str, Any]:
    shape = bench_model.SHAPES["tiny"]
    model_dir = bench_model.ensure_model(shape, work / "models", device)
    adapter_ids = adapters.ensure_adapters(model_dir, work / "decode-adapters", 2, shape.dtype)
    engine = Engine(str(model_dir), "decode-check", dtype="bfloat16" if device == "cuda" else "float32",
                    device=device, adapter_root=str(work / "decode-adapters"))
    started = time.perf_counter()
    # A small cache: the check clones it whole to replay the same step twice.
    _, num_blocks = engine.warmup(256, 128, 16, max_batch_total_tokens=4096, max_active_adapters=2,
                                  max_lora_rank=16, slot_ranks=[adapters.rank_of(i) for i in range(2)])
    report: dict[str, Any] = {"warmup_s": round(time.perf_counter() - started, 2), "kv_blocks": num_blocks,
                              "graph_buckets": engine.graphs.sizes if engine.graphs is not None else None}
    for slot, adapter_id in enumerate(adapter_ids):
        engine.lora.load(adapter_id, "local", str(work / "decode-adapters" / adapter_id))
        engine.activate_adapter(adapter_id, slot)
    requests = [RequestSpec(id=i, input_ids=list(range(3 + i, 20 + 3 * i)), blocks=[4 * i + j for j in range(4)],
                            sampling=SamplingParams(), adapter_id=adapter_ids[i % 2] if i % 3 else "")
                for i in range(ROWS)]
    engine.prefill(1, requests)
    batch = engine.batches[1]
    lengths, table = [r.length for r in batch.requests], batch.block_table(engine.device)
    slots = [r.lora_slot for r in batch.requests]
    input_ids = batch.input_ids(engine.device)
    lora = build_lora_meta(slots, [1] * ROWS, engine.lora.ranks or 0, engine.device)
    forward = build_decode(lengths, table, 16, engine.device, lora)
    assert engine.kv_cache is not None
    saved = [(k.clone(), v.clone()) for k, v in zip(engine.kv_cache.k, engine.kv_cache.v, strict=True)]
    with torch.inference_mode():
        report["eager_forward_host_syncs"], eager = _syncs(lambda: engine.model(input_ids, forward, engine.kv_cache),
                                                          device)
        if engine.graphs is None:
            report["graphs"] = "none: CUDA graphs run on CUDA with the Triton ops only"
            return report
        for (k, v), k_now, v_now in zip(saved, engine.kv_cache.k, engine.kv_cache.v, strict=True):
            k_now.copy_(k)
            v_now.copy_(v)
        graphs = engine.graphs
        report["graph_replay_host_syncs"], replayed = _syncs(lambda: graphs.run(input_ids, lengths, table, slots),
                                                             device)
    if eager is not None and replayed is not None:
        report["graph_vs_eager_max_abs_diff"] = float((replayed.float() - eager.float()).abs().max())
        report["graph_vs_eager_same_argmax"] = bool(torch.equal(replayed.argmax(-1), eager.argmax(-1)))
    return report


def _syncs(step, device: str) -> tuple[str, torch.Tensor | None]:
    """Runs `step` with synchronising CUDA calls turned into errors: "none", or the error."""
    guard = _sync_errors() if device == "cuda" else contextlib.nullcontext()
    try:
        with guard:
            out = step()
        if device == "cuda":
            torch.cuda.synchronize()
        return "none", out
    except RuntimeError as err:
        return f"{type(err).__name__}: {str(err)[:300]}", None


@contextlib.contextmanager
def _sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
