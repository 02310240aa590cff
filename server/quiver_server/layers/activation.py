"""Gated activations, [T, 2I] = [gate | up] -> act(gate) * up [T, I], as the MLPs of every
family compute them, on the shard's ops: silu (Llama, Qwen, Phi, Mixtral, Granite) and GELU
with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from quiver_server.kernels.ops import KernelOps

# config.json's hidden_act / hidden_activation -> our name
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def activation_name(config_value: str | None, default: str = "silu") -> str:
    name = ACTIVATIONS.get(config_value or default)
    if name is None:
        raise ValueError(f"activation {config_value!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name



def gated_activation(name: str, ops: KernelOps) -> Callable[[torch.Tensor], torch.Tensor]:
    """The [gate | up] -> act(gate) * up function for activation `name`."""
    if name == "silu":
        return ops.silu_and_mul
    if name == "gelu_tanh":
        return ops.gelu_tanh_and_mul
    raise ValueError(f"unknown activation {name!r}")
