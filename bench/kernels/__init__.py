"""Kernel micro-benchmarks, each run as `python -m bench.kernels.<module>`: the LoRA kernels and
their sm_90a compile report, the CPU GEMM, the grouped expert matmul, the bare-matmul floor."""
