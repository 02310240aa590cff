"""quiver's benchmarks and checks, grouped by the make target that runs them; run each entry from
the repository root as a module (`python -m bench.<group>.<module>`), so that they import each
other as `bench.…` and nothing edits sys.path:

    suite/      `make bench`: run.py and its blocks, the baselines, the JSON report
    peers/      `make bench-peers`: quiver beside vLLM-CPU and llama.cpp
    gpu_check/  `make gpu-bundle` / `make gpu-check`: the prepared check on one NVIDIA GPU
    kernels/    kernel micro-benchmarks (LoRA, CPU GEMM, grouped experts, the matmul floor)
    fixtures/   what they run on and with: models, adapters, prompts, workloads, the load client,
                the stack, statistics
"""
