"""The bare-matmul floor of one decode step: the model's weight matmuls for `batch` tokens, timed
alone on the same device and dtype (no attention, no norms, no framework). A decode step can not
be faster than this; quiver's step time (inter-token latency p50) is reported against it."""

from __future__ import annotations

import time

import torch

from bench.fixtures.bench_model import Shape


def _weight_shapes(shape: Shape) -> list[tuple[int, int]]:
    h, i = shape.hidden_size, shape.intermediate_size
    kv = h * shape.num_key_value_heads // shape.num_attention_heads
    per_layer = [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]  # qkv, o, gate+up, down
    return per_layer * shape.num_hidden_layers + [(h, shape.vocab_size)]


def step_floor_s(shape: Shape, batch: int, device: str, iters: int = 10) -> float:
    """The fastest of `iters` timed steps: a floor, so noise from other processes only ever
    makes a run slower, never the floor lower."""
    dtype = getattr(torch, shape.dtype)
    weights = [torch.randn(k, n, device=device, dtype=dtype) for k, n in _weight_shapes(shape)]
    inputs = {k: torch.randn(batch, k, device=device, dtype=dtype) for k, _ in _weight_shapes(shape)}

    def step() -> None:
        for w in weights:
            inputs[w.shape[0]] @ w

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up: kernels chosen, caches filled
    best = float("inf")
    for _ in range(iters):
        sync()
        started = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - started)
    return best
