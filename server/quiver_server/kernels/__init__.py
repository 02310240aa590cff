"""The shard's compute kernels, chosen once per shard by `ops.select_ops` (C++ on CPU, Triton on
CUDA, torch elsewhere). Import the modules themselves; this file re-exports nothing, so that
importing one kernel module loads no other.

- `ops`: the `KernelOps` families and `select_ops`; `torch_ops`, `attention_torch`: the torch ones.
- `cpu_ops`, `cpu_gemm`: the C++ kernels (`cpu/*.cpp`), built and loaded on first use.
- LoRA: `lora_projection.LoraProjection` (a projection's LoRA deltas over a chosen backend),
  `lora_meta` (per-step slot metadata), `lora_reference`, `lora_torch`, `lora_triton`.
- Quantized projections: `quant_gemm` (pack at load, dispatch per call), over the Triton layout
  `quant_triton_layout` and its two kernels `quant_matmul_triton` and `quant_gemv_triton`.
- Triton attention and row ops: `paged_decode_triton`, `prefill_triton`, `rowops_triton`;
  shared helpers `cuda_device` (SM count for launch plans) and `triton_math`.
"""
