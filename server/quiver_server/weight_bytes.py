"""How many bytes of weights a loaded model holds on this rank, whatever their layout: parameters
and buffers, and the prepacked or quantized weights that replace a projection's parameter once
packed (`layers.linear.Linear.pack_weight`). Reported per rank in /metrics
(`quiver_shard_weight_bytes`), where a split model shows each rank's share."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def held_weight_bytes(modules: Iterable[nn.Module]) -> int:
    """Of a model's modules (`named_modules()`'s), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            total += _tensor_bytes(tensor, seen)
        for value in vars(module).values():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                total += _nested_bytes(value, seen)
    return total


def _nested_bytes(value: Any, seen: set[int]) -> int:
    """The tensors inside a packed weight: a dataclass, tuple, list or dict of them, nested."""
    if isinstance(value, torch.Tensor):
        return _tensor_bytes(value, seen)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_nested_bytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return sum(_nested_bytes(item, seen) for item in value)
    if isinstance(value, dict):
        return sum(_nested_bytes(item, seen) for item in value.values())
    return 0


def _tensor_bytes(tensor: torch.Tensor, seen: set[int]) -> int:
    """A tensor's bytes, once per storage (a tied LM head shares the embedding's)."""
    if tensor.is_meta:
        return 0
    if tensor.is_mkldnn:  # oneDNN's packed weights (the torch path on CPU) expose no storage
        key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
    else:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
    if key in seen:
        return 0
    seen.add(key)
    return nbytes
