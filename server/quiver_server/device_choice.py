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


def resolve_dtype(dtype: str, config: dict, device: torch.device,
                  bf16_supported: Callable[[], bool] = torch.cuda.is_bf16_supported) -> torch.dtype:
    """"auto" on CUDA: a 16-bit checkpoint's own dtype, bfloat16 for a float32 checkpoint or one
    whose config names no dtype (float32 would double the memory and halve the speed), as vLLM
    does; float16 where the GPU has no bfloat16. On CPU float32: the reference runs float32
    there, and the CPU kernels are fastest in it."""
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        stated = config_dtype(config)
        half = stated if stated in (torch.bfloat16, torch.float16) else torch.bfloat16
        return torch.float16 if half == torch.bfloat16 and not bf16_supported() else half
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
