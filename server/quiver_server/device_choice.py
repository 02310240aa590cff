"""Where the engine runs and in which dtype: `--device` and `--dtype` resolved against the
machine and the checkpoint's config."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from quiver_server.weights import config_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str, environ: Mapping[str, str] = os.environ) -> torch.device:
    """"auto": CUDA where there is a GPU. A CUDA device without an index is this rank's:
    cuda:LOCAL_RANK under a launcher that starts one shard per GPU (torchrun's variable), else
    the current device."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        local_rank = environ.get("LOCAL_RANK")
        index = int(local_rank) if local_rank not in (None, "") else torch.cuda.current_device()
        resolved = torch.device("cuda", index)
    return resolved


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX-BF16 tiles, or AVX512-BF16 dots)."""
    from quiver_server.kernels.cpu_ops import cpu_model_and_flags  # the kernels import the engine

    _, flags = cpu_model_and_flags()
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(dtype: str, config: dict, device: torch.device,
                  bf16_supported: Callable[[], bool] = torch.cuda.is_bf16_supported,
                  cpu_bf16: Callable[[], bool] = cpu_multiplies_bfloat16) -> torch.dtype:
    """"auto" on CUDA: a 16-bit checkpoint's own dtype, bfloat16 for a float32 checkpoint or one
    whose config names no dtype (float32 would double the memory and halve the speed), as vLLM
    does; float16 where the GPU has no bfloat16. On CPU: a bfloat16 checkpoint in bfloat16 where
    the CPU multiplies it in hardware (AMX: 1.97x float32's tokens/s at 32 streams of the demo
    model, docs/benchmarks.md), else float32: an AVX2 CPU runs bfloat16 about 5x slower, and a
    float32 or float16 checkpoint keeps every bit of its weights in float32."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.bfloat16 if config_dtype(config) == torch.bfloat16 and cpu_bf16() else torch.float32
        stated = config_dtype(config)
        half = stated if stated in (torch.bfloat16, torch.float16) else torch.bfloat16
        return torch.float16 if half == torch.bfloat16 and not bf16_supported() else half
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
