"""The sparse MLP's expert matmuls at a real MoE shape (Qwen3-30B-A3B: 128 experts, top 8,
hidden 2048, expert width 768): the grouped kernel quiver uses against one matmul per expert,
on one device and dtype, as JSON (medians of timed repeats; the share of the experts' weight
bytes read per second).

    python -m bench.kernels.moe_grouped --device cuda --dtype bfloat16 > moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quiver_server.layers import grouped_linear

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5
    results = []
    for tokens in args.tokens:
        experts = torch.stack([torch.randperm(EXPERTS, device=device)[:TOP_K] for _ in range(tokens)])
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(tokens * TOP_K, HIDDEN, device=device, dtype=dtype)[order]
        touched = int((counts > 0).sum())
        weight_bytes = touched * gate_up[0].numel() * gate_up.element_size()
        grouped = _timed(lambda x=x, o=offsets: grouped_linear.grouped_linear(x, gate_up, o), device, args.repeats)
        looped = _timed(lambda x=x, o=offsets: grouped_linear.per_expert_linear(x, gate_up, o), device, args.repeats)
        results.append({
            "tokens": tokens, "experts_touched": touched,
            "grouped_ms": round(grouped * 1e3, 4), "per_expert_ms": round(looped * 1e3, 4),
            "speedup": round(looped / grouped, 2),
            "grouped_weight_gb_per_s": round(weight_bytes / grouped / 1e9, 1),
        })
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    grouped_kernel = grouped_linear.has_grouped_mm(device, dtype)
    print(json.dumps({"device": name, "dtype": args.dtype, "grouped_kernel": grouped_kernel,
                      "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "width": WIDTH},
                      "gate_up_projection": results}, indent=1))


if __name__ == "__main__":
    main()
