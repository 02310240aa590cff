"""What the Triton kernels' launch plans need to know of the device they run on."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, which the plans fill with programs (split-K,
    column splits, decode splits)."""
    if device.type != "cuda":
        return 4  # the interpreter on CPU: any small number keeps tests quick
    return torch.cuda.get_device_properties(device).multi_processor_count
