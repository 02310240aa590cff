"""The one place a shard's ops are chosen: `select_ops(device)`, called once at load, returns the
`KernelOps` the model's layers, the sampler and the adapter slots receive. Nothing outside
`kernels/` asks which device or which kernels it runs on.

- `KernelOps`: plain torch (`torch_ops`, `attention_torch`): CUDA, and CPU where the C++ kernels
  are off (QUIVER_CPU_KERNELS=0) or failed to build. Also the semantics the kernels must match.
- `CpuKernelOps`: the C++ kernels (`cpu_ops`) for the row ops, the KV write, decode attention
  (and a float8 cache's conversions in prefill) and greedy sampling, on CPU where they are built.

Chosen with them: the LoRA backend (`lora_backend`: QUIVER_LORA_BACKEND, else the device's
default), the packed matmul for float32 CPU weights (`cpu_gemm`), and the layout of the adapter
slots' lora_B buffers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from quiver_server.engine import kv_cache_dtype
from quiver_server.kernels import attention_torch, cpu_gemm, cpu_ops, quant_gemm, torch_ops
from quiver_server.quant.weights import QuantizedWeight

if TYPE_CHECKING:  # forward_batch imports kernels (lora_meta): a runtime import would be a cycle
    from quiver_server.engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "cpu", "torch", "reference")
# `--quantize-activations`: none, or int8 (the quantized projections' inputs rounded to int8 in
# blocks of 32 and multiplied in 8-bit integers: `quant_gemm`'s "cpu-int8-dot" kernel).
ACTIVATION_QUANTIZATIONS = ("none", "int8")


def lora_backend(device: torch.device, requested: str | None = None) -> str:
    """The LoRA backend for tensors on `device`: `requested`, else QUIVER_LORA_BACKEND, else
    ("auto") Triton on CUDA, the C++ kernels on CPU where they are built, torch otherwise."""
    name = requested or os.environ.get("QUIVER_LORA_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}, expected one of {BACKENDS}")
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_ops.available() else "torch"
    if name == "cpu" and not cpu_ops.available():
        raise ValueError("LoRA backend 'cpu' asked for, but the C++ CPU kernels are not available "
                         "(QUIVER_CPU_KERNELS=0, or they failed to build: see the shard's log)")
    return name


@dataclass(frozen=True)
class KernelOps:
    """The plain-torch ops. `lora_backend` is what `Linear` passes to the LoRA kernels;
    `packed_matmul` ("quiver", "onednn" or None) what float32 CPU weights are packed for;
    `quantized_activations` ("none" or "int8") how quantized projections take their inputs."""

    device: torch.device
    lora_backend: str
    packed_matmul: str | None
    quantized_activations: str = "none"
    name: ClassVar[str] = "torch"
    # Whether decode attention copies every sequence's K/V blocks into new tensors (the torch
    # path does, padded to the longest sequence): the KV budget on a GPU must leave room for it.
    decode_gathers: ClassVar[bool] = True
    # The quantized matmul (`quant_gemm`): weights dequantized per product by torch here.
    quant_kernel: ClassVar[str] = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, residual_scale: float,
        gemma: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused residual add and norm, where the ops have one: residual + x * residual_scale
        (rounded as torch rounds it, written into `residual`) and its RMSNorm (`gemma`: the
        (1 + w) form), as (norm, new residual); None where the layer adds and norms itself."""
        return None

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by cos, sin [T, 1, D]. May work in place: use the result."""
        return torch_ops.rotary(x, cos, sin)

    def partial_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] with its leading d columns rotated by cos, sin [T, 1, d] and the rest
        passed through (Phi-4-mini's partial rotary). May work in place: use the result."""
        dim = cos.shape[-1]
        return torch.cat((torch_ops.rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)

    def rotary_and_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """q|k heads qk [T, heads + kv_heads, D] rotated on their leading cos.shape[-1] columns,
        and the rotated k with v [T, kv_heads, D] stored at the cache's flat `slot_mapping` [T].
        May work in place: use the result."""
        qk = self.rotary(qk, cos, sin) if cos.shape[-1] == qk.shape[-1] else self.partial_rotary(qk, cos, sin)
        self.write_kv(k_cache, v_cache, qk[:, qk.shape[1] - v.shape[1]:], v, slot_mapping)
        return qk

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """k, v [T, kv_heads, D] rounded to the caches' dtype at their flat `slot_mapping` [T]."""
        from quiver_server.layers.attention import write_kv  # the layer imports the ops

        write_kv(k_cache, v_cache, k, v, slot_mapping)

    def kv_as_stored(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x as a KV cache in `dtype` holds it, in x's dtype (`kv_cache_dtype.as_stored`)."""
        return kv_cache_dtype.as_stored(x, dtype)

    def kv_widened(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """KV cache values in `dtype`, exactly."""
        return cache.to(dtype)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] = [gate | up] -> gelu_tanh(gate) * up [T, I] (Gemma's MLPs)."""
        return torch_ops.gelu_tanh_and_mul(gate_up)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch_ops.silu_and_mul(gate_up)

    def decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float, sliding_window: int | None, softcap: float | None = None,
    ) -> torch.Tensor:
        """q [B, heads, d], one new token per sequence, over its sequence's cached K/V (the new
        token's own K/V already written); semantics in `layers/attention.py`."""
        return attention_torch.decode_attention(q, k_cache, v_cache, batch, scale, sliding_window, softcap)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float,
        sliding_window: int | None, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float | None = None,
    ) -> torch.Tensor:
        """q [T, heads, d] of every sequence's new tokens over its context and themselves, their
        k/v [T, kv_heads, d] already written into the cache; semantics in `layers/attention.py`."""
        from quiver_server.layers.attention import prefill_attention  # the layer imports the ops

        return prefill_attention(q, k, v, batch, scale, sliding_window, k_cache, v_cache, softcap,
                                 held=self.kv_as_stored, widen=self.kv_widened)

    def greedy_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [B, V] -> (argmax token [B] long, its log-softmax [B] float32)."""
        return torch_ops.greedy_logprob(logits)

    def pack_quantized(self, weight: QuantizedWeight) -> quant_gemm.PackedQuantWeight:
        """A quantized projection weight packed for this device's kernel (`quant_gemm`)."""
        return quant_gemm.pack(weight, self.device, self.quant_kernel)

    def pack(self, weight: torch.Tensor) -> cpu_gemm.PackedWeight | None:
        """`weight` packed for `cpu_gemm.linear`, or None where it stays a plain `F.linear` weight
        (CUDA, float16, bfloat16 without AMX, QUIVER_CPU_PACKED_WEIGHTS=0)."""
        if self.packed_matmul is None or not cpu_gemm.available(weight):
            return None
        return cpu_gemm.pack(weight, self.packed_matmul)

    def lora_b_buffer(self, num_slots: int, out_features: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed stacked lora_B buffer, [S, out, R] as every LoRA backend takes it. On CPU a
        transposed view of [S, R, out] storage: the C++ BGMV then expands with one vector sweep
        per rank and skips a slot's padded ranks (kernels/cpu/lora_bgmv.cpp), and the torch paths
        take the view as it is (kept with the torch ops too, so both give the same numbers).
        CUDA keeps [S, out, R] contiguous for the Triton kernels."""
        if self.device.type == "cpu":
            storage = torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=self.device)
            return storage.transpose(1, 2)
        return torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=self.device)


@dataclass(frozen=True)
class CpuKernelOps(KernelOps):
    """The C++ kernels (`cpu_ops`), each a faster form of the torch op it replaces."""

    name: ClassVar[str] = "cpu"
    decode_gathers: ClassVar[bool] = False
    quant_kernel: ClassVar[str] = "cpu"

    def pack_quantized(self, weight: QuantizedWeight) -> quant_gemm.PackedQuantWeight:
        """Under `--quantize-activations int8`, for the 8-bit dot-product kernel where the weight
        comes in whole blocks of 32 inputs (others keep float activations: `quant_gemm`)."""
        if self.quantized_activations == "int8" and quant_gemm.int8_dot_fits(weight):
            return quant_gemm.pack(weight, self.device, "cpu-int8-dot")
        return quant_gemm.pack(weight, self.device, self.quant_kernel)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:  # the kernel takes rows of a matrix
            return torch_ops.rms_norm(x, weight, eps)
        return cpu_ops.rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rotary_(x, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))

    def partial_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The kernel takes any row and head strides: it turns the leading columns in place.
        self.rotary(x[..., : cos.shape[-1]], cos, sin)
        return x

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        cpu_ops.write_kv(k_cache, v_cache, k, v, slot_mapping)  # one call for both

    # A float8 cache's rounding and widening in one vector pass each (torch's e4m3 ones are scalar).
    def kv_as_stored(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return cpu_ops.as_stored(x, dtype)

    def kv_widened(self, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return cpu_ops.widen(cache, dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_ops.silu_and_mul(gate_up)

    def decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float, sliding_window: int | None, softcap: float | None = None,
    ) -> torch.Tensor:
        # Reads the cache in place, where the torch path gathers every sequence's blocks first.
        assert batch.block_tables is not None and batch.seq_lens is not None
        return cpu_ops.paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                              scale, sliding_window, softcap)

    def greedy_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_ops.greedy_logprob(logits)  # one fused pass per row


@dataclass(frozen=True)
class TritonKernelOps(KernelOps):
    """CUDA: the Triton kernels where they replace a torch op (they also run, slowly, in Triton's
    CPU interpreter, which is how the tests hold them to the torch ops)."""

    name: ClassVar[str] = "triton"
    decode_gathers: ClassVar[bool] = False
    quant_kernel: ClassVar[str] = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:  # the kernel takes rows of a matrix
            return torch_ops.rms_norm(x, weight, eps)
        from quiver_server.kernels import rowops_triton  # imports triton

        return rowops_triton.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, residual_scale: float,
        gemma: bool,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if x.dim() != 2:
            return None
        from quiver_server.kernels import rowops_triton

        normed = rowops_triton.rms_norm(x, weight, eps, residual=residual, residual_scale=residual_scale, gemma=gemma)
        return normed, residual

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from quiver_server.kernels import rowops_triton

        return rowops_triton.rotary_(x, cos, sin)

    def partial_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from quiver_server.kernels import rowops_triton

        return rowops_triton.rotary_(x, cos, sin)  # turns the leading cos.shape[-1] columns

    def rotary_and_write_kv(
        self, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        from quiver_server.kernels import rowops_triton

        # One launch: q and k turn in place, and the turned k and v go into their cache slots.
        return rowops_triton.rotary_and_write_kv(qk, v, cos, sin, k_cache, v_cache, slot_mapping)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from quiver_server.kernels import rowops_triton

        return rowops_triton.gated_activation(gate_up, "silu")

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from quiver_server.kernels import rowops_triton

        return rowops_triton.gated_activation(gate_up, "gelu_tanh")

    def greedy_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from quiver_server.kernels import rowops_triton

        return rowops_triton.greedy_logprob(logits)

    def decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
        scale: float, sliding_window: int | None, softcap: float | None = None,
    ) -> torch.Tensor:
        from quiver_server.kernels.paged_decode_triton import paged_decode_attention  # imports triton

        # Reads K/V in place through the block tables: no gathered copy, no padding to the longest.
        assert batch.block_tables is not None and batch.seq_lens is not None
        return paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                      sliding_window, softcap, max_seq_len=batch.kv_span or None)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float,
        sliding_window: int | None, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float | None = None,
    ) -> torch.Tensor:
        from quiver_server.kernels.prefill_triton import PrefillTiles, paged_prefill_attention  # imports triton

        # One launch for the whole batch, fresh and cached prompts alike: every key is read from
        # the paged cache, where this layer's new K/V already are. The tile table is built once
        # per pass (one small host-to-device copy) and reused by every layer.
        assert batch.block_tables is not None
        heads, head_dim = q.shape[1], q.shape[2]
        key = ("prefill_tiles", heads, k_cache.shape[2], head_dim, q.dtype)
        tiles = batch.kernel_plans.get(key)
        if tiles is None:
            tiles = PrefillTiles.build(batch.seq_lens_host, batch.context_lens_host, heads, k_cache.shape[2],
                                       head_dim, q.dtype, q.device)
            batch.kernel_plans[key] = tiles
        assert isinstance(tiles, PrefillTiles)
        return paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens_host,
                                       batch.context_lens_host, scale, sliding_window, softcap, tiles=tiles)


def select_ops(device: torch.device, quantized_activations: str = "none") -> KernelOps:
    """The ops for a shard on `device`, from what is built here and the QUIVER_* switches
    (QUIVER_CPU_KERNELS, QUIVER_LORA_BACKEND; QUIVER_CPU_PACKED_WEIGHTS is read per weight).
    quantized_activations "int8" needs the C++ CPU kernels: refused anywhere else."""
    if quantized_activations not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"unknown activation quantization {quantized_activations!r}, expected one of "
                         f"{', '.join(ACTIVATION_QUANTIZATIONS)}")
    backend = lora_backend(device)
    ops: KernelOps
    if device.type == "cpu" and cpu_ops.available():
        ops = CpuKernelOps(device, backend, packed_matmul="quiver", quantized_activations=quantized_activations)
    elif quantized_activations != "none":
        raise ValueError(f"--quantize-activations {quantized_activations} runs on the C++ CPU kernels only; this "
                         f"shard runs on {device.type}" + (" without them (QUIVER_CPU_KERNELS=0, or no compiler: see "
                                                           "the log)" if device.type == "cpu" else ""))
    elif device.type == "cuda":
        ops = TritonKernelOps(device, backend, packed_matmul=None)
    else:
        # oneDNN's packing where quiver's C++ matmul is not built (cpu_gemm checks it exists).
        ops = KernelOps(device, backend, packed_matmul="onednn" if device.type == "cpu" else None)
    log.info("ops: %s, LoRA backend %s, packed matmul %s, quantized activations %s", ops.name, ops.lora_backend,
             ops.packed_matmul, ops.quantized_activations)
    return ops
