"""Gemma 2 and Gemma 3 (text: `Gemma3ForCausalLM`) on the shared decoder.

Both: norms scaled by (1 + w), four per layer (sandwich), GELU-tanh, embeddings scaled by
sqrt(hidden_size) rounded to the dtype, attention scaled by query_pre_attn_scalar ** -0.5,
sliding-window layers interleaved with global ones, final logits soft-capped where configured.
Gemma 2 soft-caps attention scores too; Gemma 3 norms q and k per head and gives its local and
global layers their own rope.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

from quiver_server.layers.activation import activation_name
from quiver_server.layers.rotary import RopeConfig
from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.models.decoder_config import DecoderConfig, common_config, layer_windows, projection_biases
from quiver_server.models.family import ProjectionLayout
from quiver_server.models.layouts import SEPARATE

MODEL_TYPES = ("gemma2", "gemma3_text")


def _layer_types(config: dict[str, Any], num_layers: int) -> list[str]:
    """`layer_types` as written, else what older configs imply: Gemma 2 alternates local and
    global from a local first layer; Gemma 3 has one global layer in every
    `sliding_window_pattern`."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = 2 if config.get("model_type") == "gemma2" else int(config.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _gemma3_ropes(config: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(local, global) ropes: transformers 5's per-layer-type rope_parameters, or the older
    rope_theta + rope_scaling (global) and rope_local_base_freq (local)."""
    parameters = config.get("rope_parameters") or {}
    if isinstance(parameters.get("full_attention"), dict):
        return RopeConfig.from_hf(config, "sliding_attention"), RopeConfig.from_hf(config, "full_attention")
    local = RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)),
                       max_position_embeddings=int(config.get("max_position_embeddings", 2048)))
    return local, RopeConfig.from_hf(config)


class GemmaForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = SEPARATE

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Gemma 2 or 3 text model")
        config = {"tie_word_embeddings": True, **config}
        base = common_config(config)
        num_layers, hidden = base.num_layers, base.hidden_size
        layer_types = _layer_types(config, num_layers)
        cfg = replace(
            base,
            **projection_biases(config),
            norm="gemma",
            sandwich_norms=True,
            activation=activation_name(config.get("hidden_activation") or config.get("hidden_act"),
                                       default="gelu_pytorch_tanh"),
            attention_scale=float(config.get("query_pre_attn_scalar", base.head_dim)) ** -0.5,
            # transformers' Gemma 3 never applies attn_logit_softcapping (released configs set
            # none): the reference decides, so only Gemma 2 caps attention scores.
            attention_softcap=(_optional_float(config.get("attn_logit_softcapping"))
                               if model_type == "gemma2" else None),
            final_softcap=_optional_float(config.get("final_logit_softcapping")),
            embed_scale=math.sqrt(hidden),
            embed_scale_in_dtype=True,
            sliding_windows=layer_windows({**config, "layer_types": layer_types}, num_layers),
        )
        if model_type == "gemma3_text":
            local, full = _gemma3_ropes(config)
            cfg = replace(cfg, qk_norm=True, ropes=(local, full),
                          layer_ropes=tuple(1 if t == "full_attention" else 0 for t in layer_types))
        return cfg


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
