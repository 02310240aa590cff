"""Batched multi-LoRA compute: `LoraProjection`, the LoRA deltas of one projection's parts (one
part, or the parts of a fused projection, which share x), over interchangeable backends.

- "triton" (`lora_triton`): fused shrink+expand kernels; the default on CUDA. A projection runs
  all its parts in one launch over row segments grouped by adapter (`lora_triton.FusedLora`:
  decode rows sorted by slot, prefill segments); parts whose columns overlap run one at a time,
  BGMV for decode rows and SGMV for prefill segments.
- "cpu" (`cpu_ops.lora_bgmv_parts` for decode rows, `cpu_ops.lora_sgmv_parts` for prefill
  segments when lora_B is in the CPU slots' rank-major layout, `lora_torch` otherwise): the default
  on CPU where the C++ kernels build.
- "torch" (`lora_torch`): vectorised torch, no loop per token; the default elsewhere.
- "reference" (`lora_reference`): the per-token loop that defines the semantics.

A shard chooses its backend once at load (`ops.select_ops`: QUIVER_LORA_BACKEND,
auto|triton|cpu|torch|reference, else the device's default; e.g. to debug a suspected kernel bug
in a running server with the reference); each layer's `LoraProjection` binds its kernel to it
when built, so a step dispatches on nothing. One built without a backend resolves it the same
way (`ops.lora_backend`), for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from quiver_server.kernels import cpu_ops
from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.lora_reference import add_lora_reference
from quiver_server.kernels.lora_torch import add_lora_cpu, add_lora_torch
from quiver_server.kernels.ops import BACKENDS, lora_backend

if TYPE_CHECKING:  # triton is imported only when the triton backend is chosen
    from quiver_server.kernels.lora_triton import FusedLora


def _check(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, meta: LoraBatchMeta | _NoTokens, out_slice: slice,
) -> None:
    """Shape and dtype checks on host metadata only (no device sync). Runs for every target
    module of every layer, so the passing case is one boolean expression."""
    num_tokens, in_features = x.shape
    slots, rank, a_in = lora_a.shape
    b_slots, out_features, b_rank = lora_b.shape
    start, stop, step = out_slice.indices(y.shape[1])
    if (
        y.shape[0] == num_tokens == meta.token_slots.shape[0]
        and a_in == in_features
        and b_slots == slots and b_rank == rank and scaling.shape == (slots,)
        and stop - start == out_features and step == 1
        and x.dtype == lora_a.dtype == lora_b.dtype == y.dtype
        and scaling.dtype == torch.float32
    ):
        return
    problems = []
    if y.shape[0] != num_tokens or meta.num_tokens != num_tokens:
        problems.append(f"tokens: x {num_tokens}, y {y.shape[0]}, meta {meta.num_tokens}")
    if a_in != in_features:
        problems.append(f"lora_a in_features {a_in} != x's {in_features}")
    if (b_slots, b_rank) != (slots, rank) or scaling.shape != (slots,):
        problems.append(
            f"slot/rank dims differ: lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, "
            f"scaling {tuple(scaling.shape)}"
        )
    if stop - start != out_features or step != 1:
        problems.append(f"lora_b out_features {out_features} != width of {out_slice} ({stop - start})")
    if not (x.dtype == lora_a.dtype == lora_b.dtype == y.dtype):
        problems.append(f"dtypes differ: x {x.dtype}, A {lora_a.dtype}, B {lora_b.dtype}, y {y.dtype}")
    if scaling.dtype != torch.float32:
        problems.append(f"scaling must be float32, got {scaling.dtype}")
    raise ValueError("LoRA: " + "; ".join(problems))


def _resolve(backend: str | None, device: torch.device) -> str:
    """A concrete backend name passes as it is (the serving path's, checked at load); None or
    "auto" is resolved, and an unknown name refused, by `lora_backend`."""
    if backend is not None and backend != "auto" and backend in BACKENDS:
        return backend
    return lora_backend(device, backend)


PerPart = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoraBatchMeta, slice,
                    torch.Tensor | None], None]


def _per_part(backend: str) -> PerPart:
    """The function that adds one part's deltas on a resolved backend."""
    if backend == "triton":
        from quiver_server.kernels.lora_triton import add_lora_triton  # imports triton lazily

        return lambda y, x, a, b, scaling, meta, out, ranks: add_lora_triton(y, x, a, b, scaling, meta, out)
    if backend == "cpu":
        return add_lora_cpu
    if backend == "torch":
        return add_lora_torch
    return lambda y, x, a, b, scaling, meta, out, ranks: add_lora_reference(y, x, a, b, scaling, meta, out)


class LoraProjection:
    """The LoRA slots of one fused projection's parts (q|k|v, gate|up, or a single part), each
    (lora_a, lora_b, scaling, out_slice, slot_ranks), checked once here so that a decode step's
    call (`add`) checks only what changes per step. slot_ranks (int32 [S] or None) is each slot's
    own rank in that part, the rows past it being zero (see `adapters.slots`). The backend is
    resolved here too, once (None or "auto": the device's default), and with it the kernel each
    call runs. A layer keeps one per projection while the set of parts in use stays the same."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice,
                                             torch.Tensor | None]], backend: str | None = None) -> None:
        if not parts:
            raise ValueError("LoraProjection needs at least one part")
        self.parts = list(parts)
        first_a = self.parts[0][0]
        self.in_features, self.dtype, self.scaling = first_a.shape[2], first_a.dtype, self.parts[0][2]
        self.end = 0
        for lora_a, lora_b, scaling, out_slice, ranks in self.parts:
            width = lora_b.shape[1]
            probe_y = torch.empty(0, out_slice.stop or 0, dtype=lora_a.dtype, device=lora_a.device)
            probe_x = torch.empty(0, self.in_features, dtype=first_a.dtype, device=lora_a.device)
            _check(probe_y, probe_x, lora_a, lora_b, scaling, _NO_TOKENS, out_slice)
            if ranks is not None and (ranks.dtype != torch.int32 or ranks.shape != (lora_a.shape[0],)):
                raise ValueError(f"LoraProjection: slot_ranks must be int32 [{lora_a.shape[0]}], got "
                                 f"{ranks.dtype} {tuple(ranks.shape)}")
            self.end = max(self.end, out_slice.start + width)
        # The one-call CPU kernel takes one scaling vector and per-part ranks for all parts.
        self.one_call = all(part[2] is self.scaling for part in self.parts)
        self.lora_a = [part[0] for part in self.parts]
        self.lora_b = [part[1] for part in self.parts]
        self.columns = [part[3].start for part in self.parts]
        part_ranks = [part[4] for part in self.parts]
        self.ranks = [r for r in part_ranks if r is not None] if all(r is not None for r in part_ranks) else []
        self.rank_major = all(cpu_ops.rank_major(b) for b in self.lora_b)
        self.backend = _resolve(backend, first_a.device)
        self._per_part = _per_part(self.backend)
        self._cpu_one_call = self.backend == "cpu" and self.one_call
        self._triton: FusedLora | None = None
        if self.backend == "triton":
            from quiver_server.kernels.lora_triton import FusedLora  # imports triton lazily

            try:
                self._triton = FusedLora(self.parts)
            except ValueError:  # overlapping columns: one launch per part, in order
                self._triton = None

    def add(self, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta) -> None:
        """In place, for every part (lora_a, lora_b, scaling, out_slice, slot_ranks) and every
        token t with s = meta.token_slots[t] >= 0:
           y[t, out_slice] += scaling[s] * (lora_b[s] @ (lora_a[s] @ x[t]))
        x [T, in], lora_a [S, R, in], lora_b [S, out, R] (out = width of out_slice), scaling [S]
        float32, y [T, out_total]. Ranks below R are zero-padded in the buffers. x, A, B and y
        share one dtype (float32, bfloat16 or float16); products are accumulated in float32
        (`lora_reference.add_lora_reference` is the semantics, one part at a time).
        On the CPU backend a batch runs every part in one kernel call (x read once, one parallel
        region, a slot's padded ranks and untargeted parts not read): BGMV for decode rows, SGMV
        for prefill segments. On Triton every part runs in one launch over row segments grouped
        by adapter (`lora_triton.FusedLora`), padded ranks and untargeted parts not read either."""
        if not meta.has_lora or x.shape[0] == 0:
            return
        if self._triton is not None:
            self._check_step(y, x, meta)
            self._triton.add(y, x, meta)
            return
        if self._cpu_one_call and (meta.is_decode or self.rank_major):
            self._check_step(y, x, meta)
            if meta.is_decode:
                cpu_ops.lora_bgmv_parts(y, x, self.lora_a, self.lora_b, self.ranks, self.columns, self.scaling,
                                        meta.token_slots)
            else:
                cpu_ops.lora_sgmv_parts(y, x, self.lora_a, self.lora_b, self.ranks, self.columns, self.scaling,
                                        meta.seg_indptr, meta.seg_slots)
            return
        for lora_a, lora_b, scaling, out_slice, ranks in self.parts:
            _check(y, x, lora_a, lora_b, scaling, meta, out_slice)
            self._per_part(y, x, lora_a, lora_b, scaling, meta, out_slice, ranks)

    def _check_step(self, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta) -> None:
        """What the one-call kernels need of a step's tensors (the parts were checked once)."""
        if not (x.dim() == 2 and x.shape[1] == self.in_features and y.shape[0] == x.shape[0] == meta.num_tokens
                and y.shape[1] >= self.end and x.dtype == y.dtype == self.dtype):
            raise ValueError(f"LoraProjection: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype} and "
                             f"{meta.num_tokens} tokens do not fit parts of in_features {self.in_features}, "
                             f"dtype {self.dtype}, columns up to {self.end}")


class _NoTokens:
    """The metadata `_check` sees when LoraProjection checks its parts' static shapes."""

    num_tokens = 0
    token_slots = torch.empty(0, dtype=torch.int32)


_NO_TOKENS = _NoTokens()

