"""Rotary position embeddings (RoPE) with the scaling variants of the Llama family.

Frequencies are computed with the same float32 steps as transformers' `modeling_rope_utils`, so
the cos/sin values are bit-identical to the reference for the same positions.

Supported `rope_type`s: default, linear (position interpolation), llama3 (Llama 3.1 smoothing)
and dynamic (NTK). Dynamic NTK rescales only once a sequence grows past
`max_position_embeddings`; below that it is exactly the default RoPE, and the engine never
serves positions past `max_position_embeddings`, so it is the default here.

The rotation itself is the shard's `KernelOps.rotary` (`kernels.torch_ops.rotary` states it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        """Reads both config.json layouts: transformers 5's `rope_parameters` dict and the older
        top-level `rope_theta` + `rope_scaling` (whose type key is `type` or `rope_type`)."""
        params: dict[str, Any] = {}
        params.update(config.get("rope_scaling") or {})
        params.update(config.get("rope_parameters") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported by the Llama family")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported")
        max_pos = int(config.get("max_position_embeddings", 2048))
        return cls(
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get(
                    "original_max_position_embeddings",
                    config.get("original_max_position_embeddings", max_pos),
                )
            ),
        )


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies for `rope`."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_smoothing(inv_freq, rope)
    return inv_freq


def _llama3_smoothing(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, and the band in between
    # interpolated linearly in 1/wavelength (Llama 3.1's scheme).
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin for arbitrary (per-token) positions; computed per forward, shared by all layers."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

