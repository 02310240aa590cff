"""`make gpu-check` phase `kernels` -> kernels.json: the device's copy bandwidth (a large
device-to-device copy), then each kernel's bytes moved over its time as a share of it:

- LoRA: the Triton BGMV/SGMV kernels (`kernels/lora_triton.py`) on the check model's projections
  (decode at 32 and 128 rows over 32 adapters, a prefill over 8), eager and as a CUDA graph of many
  calls, next to the torch path; every output is checked against float64 math first
  (`bench/kernels/lora.py` supplies cases, inputs, floor and timers);
- paged decode attention: what the shard runs on the device (`ops.select_ops(device)`), the
  gathering torch path (`attention_torch`), and the `paged_decode_attention` of every other kernel
  module of `quiver_server.kernels` (the Triton kernel, `paged_decode_triton.py`), each checked
  against the torch path's output.

Bytes moved are the fewest the operation must move (every input read once, the output written
once), so the share is a lower bound of the bandwidth the kernel reaches.

Last, one decode step of the real engine (`decode_check.py`): eager and replayed from its
CUDA graph, each with synchronising calls turned into errors, and the two compared.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from bench.gpu_check.common import log, phase_options, write_report
from bench.gpu_check.decode_check import decode_step_check
from bench.gpu_check.phase_model import check_shape
from bench.kernels import lora as lora_kernels

from quiver_server.engine.forward_batch import ForwardBatch, build_decode
from quiver_server.kernels import attention_torch
from quiver_server.kernels.ops import select_ops

KV_BLOCK = 16
# Modules of quiver_server.kernels that are not the Triton paged attention (the C++ one has its
# own `paged_decode_attention`, CPU only).
NOT_TRITON = {"cpu_ops", "cpu_gemm", "ops", "torch_ops", "attention_torch"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], device: str, min_time_ms: float, repeats: int) -> float:
    """Median seconds per call of `fn` (CUDA events on the device)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    iters = max(1, min(1000, int(min_time_ms / 1e3 / max(time.perf_counter() - start, 1e-7))))
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3 / iters)
        else:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


# ---- LoRA ------------------------------------------------------------------------------------

def lora_cases(which: str) -> list[lora_kernels.Case]:
    if which == "quick":
        return lora_kernels.cases("cpu", quick=True)
    shape = check_shape(which)
    h, i = shape.hidden_size, shape.intermediate_size
    kv = h * shape.num_key_value_heads // shape.num_attention_heads
    out = []
    for name, k, n in [("q/o", h, h), ("k/v", h, kv), ("gate/up", h, i), ("down", i, h)]:
        for batch in (32, 128):
            out.append(lora_kernels.Case(f"{name} decode b{batch} a32 r16", (1,) * batch, 32, k, n, 16))
        out.append(lora_kernels.Case(f"{name} prefill 16x128 a8 r16", (128,) * 16, 8, k, n, 16))
    return out


def lora_case(case: lora_kernels.Case, device: str, dtype: torch.dtype, bandwidth_gbs: float,
              min_time_ms: float, repeats: int) -> dict:
    from quiver_server.kernels import lora_torch
    from quiver_server.kernels.lora_triton import add_lora_triton

    gen = torch.Generator(device=device).manual_seed(0)
    meta, _ = lora_kernels.make_meta(case, device)
    probe = lora_kernels.make_inputs(case, dtype, device, gen)
    per_set = sum(t.numel() * t.element_size() for t in asdict(probe).values())
    sets = [probe] + [lora_kernels.make_inputs(case, dtype, device, gen)
                      for _ in range(min(7, (128 << 20) // per_set))]  # past the L2 cache together
    floor_bytes = lora_kernels.floor_bytes(case, dtype)
    want = lora_kernels.expected(probe, meta)
    row: dict[str, Any] = {"case": case.name, "tokens": case.num_tokens, "adapters": case.adapters,
                           "in": case.in_features, "out": case.out_features, "rank": case.rank,
                           "floor_bytes": floor_bytes, "results": {}}
    backends = {"triton": add_lora_triton, "torch": lora_torch.add_lora_torch}
    # Correctness first, on pristine inputs: the timing accumulates into the sets' y.
    errors = {name: lora_kernels.relative_error(fn, probe, meta, want) for name, fn in backends.items()}
    for name, fn in backends.items():
        result: dict[str, Any] = {"rel_error": errors[name]}
        seconds = lora_kernels.time_eager(fn, sets, meta, device, min_time_ms, repeats)
        result |= _bandwidth(seconds, floor_bytes, bandwidth_gbs)
        if name == "triton" and device == "cuda":
            try:
                graph_s = lora_kernels.time_graph(fn, sets, meta, repeats)
                result["graph"] = _bandwidth(graph_s, floor_bytes, bandwidth_gbs)
            except Exception as exc:  # a capture problem must not lose the eager numbers
                result["graph_error"] = repr(exc)
        row["results"][name] = result
    return row


# ---- paged decode attention ------------------------------------------------------------------

def triton_attention() -> dict[str, Callable[..., torch.Tensor]]:
    """`paged_decode_attention` of every kernel module that has one (found by reading the
    sources, so modules without it are not imported)."""
    import quiver_server.kernels as kernels

    found = {}
    for module in pkgutil.iter_modules(kernels.__path__):
        if module.name in NOT_TRITON or module.ispkg:
            continue
        source = f"{kernels.__path__[0]}/{module.name}.py"
        try:
            with open(source) as handle:
                if "def paged_decode_attention" not in handle.read():
                    continue
        except OSError:
            continue
        loaded = importlib.import_module(f"quiver_server.kernels.{module.name}")
        fn = getattr(loaded, "paged_decode_attention", None)
        if callable(fn):
            found[f"{module.name}.paged_decode_attention"] = fn
    return found


def _attention_call(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    batch: ForwardBatch, scale: float) -> Callable[[], torch.Tensor]:
    """A call of `fn` in the form its signature takes: the C++ kernel's (block tables and
    lengths) or the ops' (a ForwardBatch)."""
    parameters = list(inspect.signature(fn).parameters)
    if "batch" in parameters:
        return lambda: fn(q, k, v, batch, scale, None)
    return lambda: fn(q, k, v, batch.block_tables, batch.seq_lens, scale, None)


def attention_case(sequences: int, context: int, device: str, dtype: torch.dtype, bandwidth_gbs: float,
                   heads: int, kv_heads: int, head_dim: int, min_time_ms: float, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(sequences * 7 + context)
    per_seq = -(-context // KV_BLOCK)
    num_blocks = sequences * per_seq + 3
    table = torch.randperm(num_blocks, generator=gen, device=device)[: sequences * per_seq].view(sequences, per_seq)
    k = torch.randn(num_blocks, KV_BLOCK, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(num_blocks, KV_BLOCK, kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(sequences, heads, head_dim, generator=gen, device=device, dtype=dtype)
    batch = build_decode([context - 1] * sequences, table, KV_BLOCK, torch.device(device))
    scale = head_dim ** -0.5
    element = k.element_size()
    floor_bytes = element * (2 * sequences * context * kv_heads * head_dim + 2 * q.numel())
    want = attention_torch.decode_attention(q, k, v, batch, scale, None).float()
    ops = select_ops(torch.device(device))
    candidates: dict[str, Callable[..., torch.Tensor]] = {
        f"ops.{ops.name}": ops.decode_attention,  # what the shard runs on this device
        "torch_gather": attention_torch.decode_attention,  # the gathering torch path, for comparison
        **triton_attention()}
    row: dict[str, Any] = {"sequences": sequences, "context": context, "heads": heads, "kv_heads": kv_heads,
                           "head_dim": head_dim, "floor_bytes": floor_bytes, "results": {}}
    for name, fn in candidates.items():
        try:
            call = _attention_call(fn, q, k, v, batch, scale)
            got = call().float()
            error = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            row["results"][name] = {"rel_error_vs_torch": error,
                                    **_bandwidth(time_call(call, device, min_time_ms, repeats), floor_bytes,
                                                 bandwidth_gbs)}
        except Exception as exc:  # a kernel in the making may not run yet: reported, not fatal
            row["results"][name] = {"error": repr(exc)[:500]}
    return row


def _bandwidth(seconds: float, floor_bytes: int, bandwidth_gbs: float) -> dict:
    achieved = floor_bytes / seconds / 1e9
    return {"us": round(seconds * 1e6, 2), "achieved_gbs": round(achieved, 1),
            "share_of_copy_bandwidth": round(achieved / bandwidth_gbs, 3)}


def main() -> None:
    options = phase_options()
    device = options.device
    shape = check_shape(options.profile.shape)
    dtype = getattr(torch, shape.dtype)
    quick = options.profile.lora_cases == "quick"
    min_time_ms, repeats = (1.0, 1) if quick else (20.0, 3)
    bandwidth = lora_kernels.peak_bandwidth_gbs(device)
    log(f"copy bandwidth {bandwidth:.0f} GB/s")
    report: dict[str, Any] = {"status": "partial",
                              "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                              "dtype": shape.dtype, "copy_bandwidth_gbs": round(bandwidth, 1),
                              "lora": [], "paged_decode_attention": []}

    heads = shape.num_attention_heads
    head_dim = shape.hidden_size // heads
    for sequences, context in options.profile.attention_cases:
        row = attention_case(sequences, context, device, dtype, bandwidth, heads, shape.num_key_value_heads,
                             head_dim, min_time_ms, repeats)
        report["paged_decode_attention"].append(row)
        log(f"attention b{sequences} ctx{context}: {row['results']}")
        write_report(options, "kernels.json", report)
    for case in lora_cases(options.profile.lora_cases):
        try:
            row = lora_case(case, device, dtype, bandwidth, min_time_ms, repeats)
        except Exception as exc:
            row = {"case": case.name, "error": repr(exc)[:500]}
        report["lora"].append(row)
        log(f"lora {case.name}: {row.get('results', row.get('error'))}")
        write_report(options, "kernels.json", report)
    try:
        report["decode_step"] = decode_step_check(options.work, device)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        report["decode_step"] = {"error": repr(exc)[:500]}
    log(f"decode step: {report['decode_step']}")
    report["status"] = "ok"
    write_report(options, "kernels.json", report)


if __name__ == "__main__":
    main()
