"""The Llama family — Llama, Mistral, Qwen2, Qwen3 — on the shared decoder.

What differs is read from config.json: Qwen2 has q/k/v biases, Mistral (and Qwen when enabled)
a sliding attention window, Llama optional attention/MLP biases and RoPE scaling, Qwen3
per-head q/k norms.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.models.decoder_config import (
    DecoderConfig,
    common_config,
    layer_windows,
    projection_biases,
    uniform_windows,
)
from quiver_server.models.family import ProjectionLayout
from quiver_server.models.layouts import SEPARATE

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def qwen_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/3: a sliding window only when `use_sliding_window`, on the layers `layer_types`
    names (older configs: the layers from `max_window_layers` on)."""
    if not config.get("use_sliding_window", False) or config.get("sliding_window") is None:
        return (None,) * num_layers
    if not config.get("layer_types"):
        first = config.get("max_window_layers", 28)
        config = {**config, "layer_types": [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]}
    return layer_windows(config, num_layers)


class LlamaForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = SEPARATE

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not in the Llama family {MODEL_TYPES}")
        cfg = common_config(config)
        if cfg.activation != "silu":
            raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported (the Llama family uses silu)")
        num_layers = cfg.num_layers
        cfg = replace(cfg, **projection_biases(config))
        if model_type == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias.
            cfg = replace(cfg, qkv_bias=True, o_bias=False, sliding_windows=qwen_windows(config, num_layers))
        elif model_type == "qwen3":
            cfg = replace(cfg, qk_norm=True, sliding_windows=qwen_windows(config, num_layers))
        elif model_type == "mistral":
            cfg = replace(cfg, sliding_windows=uniform_windows(config, num_layers))
        return cfg
