"""Rotary position embeddings (RoPE) and their scaling variants.

Frequencies are computed with the same float32 steps as transformers' `modeling_rope_utils`, so
the cos/sin values are bit-identical to the reference for the same positions.

Supported `rope_type`s: default, linear (position interpolation), llama3 (Llama 3.1 smoothing),
dynamic (NTK), yarn and longrope (Phi-3). Dynamic NTK rescales only once a sequence grows past
`max_position_embeddings`; below that it is exactly the default RoPE, and the engine never
serves positions past `max_position_embeddings`, so it is the default here. LongRoPE has two
frequency sets: a sequence uses the long one for its tokens of a pass once its length passes
`original_max_position_embeddings` (transformers decides by the length of the sequence it is
run on; a batch here decides per sequence, never by its neighbours).

`partial_rotary_factor` < 1 rotates only the first part of each head (Phi-4-mini); a family with
per-layer-type rope parameters (Gemma 3) builds one `RopeConfig` per layer type.

The rotation itself is the shard's `KernelOps.rotary` (`kernels.torch_ops.rotary` states it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_factor: float | None = None  # yarn / longrope: cos and sin are scaled by it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    max_position_embeddings: int = 2048

    @classmethod
    def from_hf(cls, config: dict[str, Any], layer_type: str | None = None) -> RopeConfig:
        """Reads both config.json layouts: transformers 5's `rope_parameters` dict and the older
        top-level `rope_theta` + `rope_scaling` (whose type key is `type` or `rope_type`).
        `layer_type` picks one entry of a per-layer-type `rope_parameters` (Gemma 3)."""
        params: dict[str, Any] = {}
        params.update(config.get("rope_scaling") or {})
        rope_parameters = config.get("rope_parameters") or {}
        if layer_type is not None and isinstance(rope_parameters.get(layer_type), dict):
            rope_parameters = rope_parameters[layer_type]
        params.update(rope_parameters)
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are only supported by families that declare "
                             "layer types (Gemma 3)")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        max_pos = int(config.get("max_position_embeddings", 2048))
        original = int(params.get("original_max_position_embeddings",
                                  config.get("original_max_position_embeddings", max_pos)))
        factor = params.get("factor")
        if factor is None:
            # yarn and longrope derive it from the context extension when the config omits it.
            factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0

        def optional(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        return cls(
            theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            partial_rotary_factor=float(params.get("partial_rotary_factor",
                                                   config.get("partial_rotary_factor", 1.0))),
            attention_factor=optional("attention_factor"),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=optional("mscale"),
            mscale_all_dim=optional("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            max_position_embeddings=max_pos,
        )

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of each head are rotated."""
        return int(head_dim * self.partial_rotary_factor)

    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (yarn and longrope temper attention)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
            return _yarn_mscale(self.factor)
        if self.rope_type == "longrope" and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """float32 [rotary_dim // 2] inverse frequencies for `rope` (`long`: LongRoPE's long set)."""
    dim = rope.rotary_dim(head_dim)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * pos_freqs)
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_smoothing(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_blend(rope, dim, pos_freqs)
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


def _yarn_blend(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    # YaRN: dimensions that turn many times over the original context keep their frequency
    # (extrapolate), slow ones are interpolated by `factor`, with a linear ramp in between.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RotaryEmbedding:
    """cos/sin for arbitrary (per-token) positions; computed per forward, shared by the layers
    that use this rope."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.rope = rope
        self.scale = rope.cos_sin_scale()
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)
        self.long_inv_freq = (
            inverse_frequencies(rope, head_dim, long=True).to(device) if rope.rope_type == "longrope" else None
        )

    @property
    def needs_sequence_ends(self) -> bool:
        """LongRoPE picks its frequencies by each token's sequence length (`cos_sin`'s `sequence_ends`)."""
        return self.long_inv_freq is not None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, sequence_ends: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim] in `dtype` (broadcast over heads).
        sequence_ends [T]: each token's sequence length at the end of this pass (LongRoPE only)."""
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            assert sequence_ends is not None, "LongRoPE needs each token's sequence length"
            is_long = sequence_ends[:, None] > self.rope.original_max_position_embeddings
            inv_freq = torch.where(is_long, self.long_inv_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)
