"""Copies into adapter slots that open no OpenMP team on CPU.

Slots are filled on a thread of their own, beside the engine thread's steps (`slots.py`).
ATen runs an op over more than 32768 elements as an OpenMP parallel region, and OpenMP gives
each thread that opens one a team of its own; a second team made the engine's decode steps
20-35% slower on 2 cores (docs/architecture.md, "Threads"). So on CPU a large copy goes in
pieces below that grain, split along the destination's outermost dimension in memory (each
piece writes whole rows). The pieces cost a few microseconds each; a rank-64 adapter of the
bench model is about 600 of them. CUDA copies go whole, on the slot copier's stream.
"""

from __future__ import annotations

import torch

# Elements per op: well below ATen's parallel grain (at::internal::GRAIN_SIZE, 32768).
SERIAL_ELEMENTS = 16384


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) (same shape), in serial pieces on CPU."""
    if dst.device.type != "cpu" or dst.numel() <= SERIAL_ELEMENTS:
        dst.copy_(src, non_blocking=True)
        return
    dim = _outermost(dst)
    step = _piece(dst, dim)
    for start in range(0, dst.shape[dim], step):
        length = min(step, dst.shape[dim] - start)
        copy_into(dst.narrow(dim, start, length), src.narrow(dim, start, length))


def zero(dst: torch.Tensor) -> None:
    """dst.zero_(), in serial pieces on CPU."""
    if dst.device.type != "cpu" or dst.numel() <= SERIAL_ELEMENTS:
        dst.zero_()
        return
    dim = _outermost(dst)
    step = _piece(dst, dim)
    for start in range(0, dst.shape[dim], step):
        zero(dst.narrow(dim, start, min(step, dst.shape[dim] - start)))


def _outermost(tensor: torch.Tensor) -> int:
    """The dimension of more than one element with the largest stride."""
    return max((d for d in range(tensor.dim()) if tensor.shape[d] > 1), key=tensor.stride)


def _piece(tensor: torch.Tensor, dim: int) -> int:
    """How many entries of `dim` one piece takes (at least one; a piece too large still is
    split further along its next dimension)."""
    return max(1, tensor.shape[dim] * SERIAL_ELEMENTS // tensor.numel())
