"""`make gpu-check` phase `quant` -> quant.json: the Triton quantized projections
(`kernels/quant_matmul_triton.py`, `kernels/quant_gemv_triton.py`) on the check model's projection
shapes, against the dense product (`F.linear`) of the same shape in the activation dtype
(bfloat16 on the device, the tiny shape's float32 on CPU).

Per projection (q/k/v fused, o, gate/up fused, down) and weight format (`--quantize int8`, per
output channel; `--quantize int4` in groups of 128, AWQ/GPTQ's group; 4 bits in groups of 32,
GGUF's Q4_0/Q4_1 group), from a random weight quantized as the shard quantizes at load:

- the error against float64 math on the dequantized weight, at 1, 4 and 32 rows;
- the time per product at each row count (decode 1 to 32 rows, prefill chunks), as a CUDA graph of
  many launches over rotating copies of the weight (past the L2 cache together, so each launch
  reads its weight from DRAM, as a model's layers do), and what that is in GB/s of the weight's
  bytes and as a share of the device's copy bandwidth; 1 to 4 rows also on the dot kernel, the
  path they took before the multiply-add kernel;
- a sweep of the multiply-add kernel's launch choices on the o projection at the row counts it
  serves, each choice of the plan changed in turn, so the plan can be checked against the best.

On CPU (the smoke run) the same runs at the tiny shape under Triton's interpreter, eagerly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_check.common import log, phase_options, write_report
from bench.gpu_check.phase_model import check_shape
from bench.kernels import lora as lora_kernels

from quiver_server.kernels.quant_gemv_triton import GemvConfig, GemvPlan, gemv_plan
from quiver_server.kernels.quant_gemm import triton_linear
from quiver_server.kernels.quant_matmul_triton import LaunchConfig
from quiver_server.kernels.quant_triton_layout import TritonQuantWeight, pack_for_triton
from quiver_server.quant.quantize import quantize_int4, quantize_int8
from quiver_server.quant.weights import QuantizedWeight

FORMATS: dict[str, Callable[[torch.Tensor], QuantizedWeight]] = {
    "int8": quantize_int8,
    "int4-g128": lambda w: quantize_int4(w, 128),
    "int4-g32": lambda w: quantize_int4(w, 32),
}
ROWS = {"full": (1, 2, 4, 8, 16, 32, 128, 1024), "quick": (1, 4, 8)}
ERROR_ROWS = (1, 4, 32)
SWEEP_CASES = (("int8", 1), ("int4-g128", 1), ("int4-g128", 2), ("int4-g32", 4))  # (format, rows)


def sweep_configs(plan: GemvPlan, quick: bool) -> list[GemvConfig]:
    """The multiply-add kernel's plan (the first entry) and one change of each of its choices."""
    if quick:
        return [GemvConfig(), GemvConfig(magic=False)]
    return [
        GemvConfig(),
        GemvConfig(split_k=2 * plan.split_k),
        GemvConfig(split_k=max(1, plan.split_k // 2)),
        GemvConfig(block_n=192 - plan.block_n),  # 64 <-> 128
        GemvConfig(scale_after=not plan.scale_after),
        GemvConfig(magic=not plan.magic),
        GemvConfig(num_stages=plan.num_stages + 1),
        GemvConfig(block_r=2 * plan.block_r),
    ]


ROTATION_BYTES = 256 << 20  # copies of a weight together exceed the 50 MB L2 several times over


def projections(shape_name: str) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of the model's fused projections."""
    shape = check_shape(shape_name)
    h, i = shape.hidden_size, shape.intermediate_size
    kv = h * shape.num_key_value_heads // shape.num_attention_heads
    return [("qkv", h, h + 2 * kv), ("o", h, h), ("gate_up", h, 2 * i), ("down", i, h)]


def _copy_count(nbytes: int, device: str) -> int:
    """Copies of a weight to rotate through: past the L2 cache together on the device; one under
    the CPU interpreter, where only the plumbing is measured."""
    return min(16, max(1, ROTATION_BYTES // nbytes)) if device == "cuda" else 1


def _copies(packed: TritonQuantWeight, count: int) -> list[TritonQuantWeight]:
    """`count` independent copies (their own bytes and split-K counters)."""
    out = [packed]
    for _ in range(count - 1):
        out.append(dataclasses.replace(
            packed, q=packed.q.clone(), scales=packed.scales.clone(),
            offsets=None if packed.offsets is None else packed.offsets.clone(), counters=packed.counters.clone()))
    return out


def packed_bytes(packed: TritonQuantWeight) -> int:
    return sum(t.nbytes for t in (packed.q, packed.scales, packed.offsets) if t is not None)


def time_rotating(calls: Sequence[Callable[[], Any]], device: str, repeats: int) -> float:
    """Median seconds per call over `calls` in turn: a CUDA graph of 10 rounds on the device (the
    launches' host cost is not what is measured), plain calls on the CPU."""
    if device == "cuda":
        return lora_kernels.time_calls_in_graph(calls, 10, repeats)
    started = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - started) / len(calls)


def _rate(seconds: float, weight_bytes: int, bandwidth_gbs: float) -> dict[str, float]:
    gbs = weight_bytes / seconds / 1e9
    return {"us": round(seconds * 1e6, 2), "weight_gbs": round(gbs, 1),
            "share_of_copy_bandwidth": round(gbs / bandwidth_gbs, 3)}


def relative_error(weight: QuantizedWeight, packed: TritonQuantWeight, x: torch.Tensor,
                   config: LaunchConfig | GemvConfig | None = None) -> float:
    w = weight.q.double() * weight.scales.double().repeat_interleave(weight.group_size, dim=1)
    if weight.offsets is not None:
        w += weight.offsets.double().repeat_interleave(weight.group_size, dim=1)
    want = x.double() @ w.T
    got = triton_linear(x, packed, None, config).double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def projection_case(name: str, k: int, n: int, rows: tuple[int, ...], device: str, dtype: torch.dtype,
                    bandwidth_gbs: float, repeats: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(k * 31 + n)
    dense = torch.randn(n, k, generator=gen, device=device, dtype=torch.float32) * 0.02
    base = dense.to(dtype)
    dense_bytes = base.nbytes
    bases = [base] + [base.clone() for _ in range(_copy_count(dense_bytes, device) - 1)]
    row: dict[str, Any] = {"projection": name, "in": k, "out": n, "dense_bytes": dense_bytes, "formats": {}}
    xs = {m: torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype) for m in rows}
    row["dense"] = {str(m): _rate(time_rotating([partial(F.linear, xs[m], w) for w in bases], device, repeats),
                                  dense_bytes, bandwidth_gbs) for m in rows}
    del bases
    for fmt, quantize in FORMATS.items():
        weight = quantize(base)
        packed = pack_for_triton(weight, device)
        weight_bytes = packed_bytes(packed)
        copies = _copies(packed, _copy_count(weight_bytes, device))
        errors = {}
        for m in ERROR_ROWS:
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
            errors[str(m)] = round(relative_error(weight, packed, x), 8)
        result: dict[str, Any] = {"bytes": weight_bytes, "bytes_vs_dense": round(weight_bytes / dense_bytes, 3),
                                  "rel_error_vs_float64": errors, "rows": {}}
        for m in rows:
            x = xs[m]
            default = [partial(triton_linear, x, p) for p in copies]
            timed: dict[str, Any] = {"default": _rate(time_rotating(default, device, repeats), weight_bytes,
                                                      bandwidth_gbs)}
            if m <= 4:
                dot = [partial(triton_linear, x, p, None, LaunchConfig()) for p in copies]
                timed["dot_kernel"] = _rate(time_rotating(dot, device, repeats), weight_bytes, bandwidth_gbs)
                timed["gemv_plan"] = dataclasses.asdict(gemv_plan(m, packed, torch.device(device)))
            timed["speedup_vs_dense"] = float(f"{row['dense'][str(m)]['us'] / timed['default']['us']:.4g}")
            result["rows"][str(m)] = timed
        row["formats"][fmt] = result
        log(f"quant {name} {fmt}: " + ", ".join(f"{m} rows {r['default']['us']} us ({r['speedup_vs_dense']}x dense)"
                                                for m, r in result["rows"].items()))
        del copies, packed
    return row


def sweep_case(name: str, k: int, n: int, fmt: str, rows: int, device: str, dtype: torch.dtype,
               bandwidth_gbs: float, repeats: int, quick: bool) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(k + n + rows)
    weight = FORMATS[fmt]((torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype))
    packed = pack_for_triton(weight, device)
    weight_bytes = packed_bytes(packed)
    copies = _copies(packed, _copy_count(weight_bytes, device))
    x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    plan = gemv_plan(rows, packed, torch.device(device))
    results = []
    for config in sweep_configs(plan, quick):
        entry: dict[str, Any] = {"config": {f: v for f, v in dataclasses.asdict(config).items() if v is not None}}
        try:
            entry["rel_error_vs_float64"] = round(relative_error(weight, packed, x, config), 8)
            calls = [partial(triton_linear, x, p, None, config) for p in copies]
            entry |= _rate(time_rotating(calls, device, repeats), weight_bytes, bandwidth_gbs)
        except Exception as exc:  # noqa: BLE001 - a launch choice that does not compile is reported
            entry["error"] = repr(exc)[:300]
        results.append(entry)
    timed = [r for r in results if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    first = results[0]  # the plan's own choices
    return {"projection": name, "format": fmt, "rows": rows, "plan": dataclasses.asdict(plan), "results": results,
            "best": best, "plan_within_5pct_of_best": bool(best and "us" in first and first["us"] <= 1.05 * best["us"])}


def main() -> None:
    options = phase_options()
    device = options.device
    shape = check_shape(options.profile.shape)
    dtype = torch.bfloat16 if device == "cuda" else getattr(torch, shape.dtype)
    quick = options.profile.lora_cases == "quick"
    repeats = 1 if quick else 5
    rows = ROWS["quick" if quick else "full"]
    bandwidth = lora_kernels.peak_bandwidth_gbs(device)
    report: dict[str, Any] = {"status": "partial", "dtype": str(dtype).removeprefix("torch."),
                              "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
                              "copy_bandwidth_gbs": round(bandwidth, 1), "projections": [], "gemv_sweep": []}
    shapes = projections(options.profile.shape)
    for name, k, n in shapes:
        report["projections"].append(projection_case(name, k, n, rows, device, dtype, bandwidth, repeats))
        write_report(options, "quant.json", report)
    name, k, n = shapes[1]  # o: square, the shape the plan was swept on
    for fmt, m in SWEEP_CASES:
        case = sweep_case(name, k, n, fmt, m, device, dtype, bandwidth, repeats, quick)
        report["gemv_sweep"].append(case)
        log(f"sweep {name} {fmt} {m} rows: plan {case['results'][0].get('us')} us, best {case['best']}")
        write_report(options, "quant.json", report)
    report["status"] = "ok"
    write_report(options, "quant.json", report)


if __name__ == "__main__":
    main()
