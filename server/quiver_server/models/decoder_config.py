"""The shape of a decoder-only transformer, as every served family describes itself to the shared
layers in `models/decoder.py`. A family's file reads its config.json into a `DecoderConfig`;
each field is one piece the layers switch on, with the default the Llama family has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from quiver_server.layers.activation import activation_name
from quiver_server.layers.rotary import RopeConfig


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: `num_experts` gated experts of width `intermediate_size`, `top_k` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral always)
    weights_in_float32: bool  # Mixtral keeps the routing weights in float32; Qwen3-MoE casts them


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    ropes: tuple[RopeConfig, ...]  # the distinct rotary embeddings
    layer_ropes: tuple[int, ...]  # per layer: its index into `ropes`
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    tie_word_embeddings: bool = False
    has_lm_head: bool = True  # False: a bare base model's untied checkpoint, embeddings only (checkpoint_layout)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm: str = "rms"  # "rms" (Llama) or "gemma" (scale 1 + w)
    qk_norm: bool = False  # per-head norms of q and k before the rotary embedding (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and around the MLP too (Gemma 2 and 3)
    activation: str = "silu"  # "silu" or "gelu_tanh"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float = 1.0
    embed_scale_in_dtype: bool = False  # Gemma rounds its sqrt(hidden_size) to the dtype first
    residual_multiplier: float = 1.0  # Granite scales each block's output before the residual add
    logits_divisor: float = 1.0  # Granite's logits_scaling
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    moe: MoeConfig | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MLP (True) or dense

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def common_config(config: dict[str, Any]) -> DecoderConfig:
    """The DecoderConfig fields every family reads the same way from config.json, the rest at
    their (Llama) defaults: a family `replace`s what it reads differently."""
    num_layers = int(config["num_hidden_layers"])
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    # A per-layer-type rope (Gemma 3) is the family's to split; the global one stands in here.
    per_layer_type = isinstance((config.get("rope_parameters") or {}).get("full_attention"), dict)
    rope = RopeConfig.from_hf(config, "full_attention" if per_layer_type else None)
    return DecoderConfig(
        model_type=str(config.get("model_type")),
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        ropes=(rope,),
        layer_ropes=(0,) * num_layers,
        sliding_windows=(None,) * num_layers,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        activation=activation_name(config.get("hidden_act") or config.get("hidden_activation")),
    )


class Biases(TypedDict):
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


def projection_biases(config: dict[str, Any]) -> Biases:
    """The bias fields from `attention_bias` (q, k, v and o) and `mlp_bias`, as Llama-style
    configs write them (both absent: no biases)."""
    attention = bool(config.get("attention_bias", False))
    return Biases(qkv_bias=attention, o_bias=attention, mlp_bias=bool(config.get("mlp_bias", False)))


def uniform_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """One `sliding_window` (or none) for every layer (Mistral, Phi-3, Mixtral)."""
    window = config.get("sliding_window")
    return (None if window is None else int(window),) * num_layers


def layer_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows from `layer_types` ("sliding_attention" / "full_attention")."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" and window is not None else None for t in layer_types)
