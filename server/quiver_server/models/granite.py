"""IBM Granite (3.x dense, `model_type` granite): a Llama with four multipliers — embeddings
times `embedding_multiplier`, attention scaled by `attention_multiplier`, each block's output
times `residual_multiplier` before the residual add, logits divided by `logits_scaling`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.models.decoder_config import DecoderConfig, common_config, projection_biases
from quiver_server.models.family import ProjectionLayout
from quiver_server.models.layouts import SEPARATE

MODEL_TYPES = ("granite",)


class GraniteForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = SEPARATE

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        base = common_config(config)
        return replace(
            base,
            **projection_biases(config),
            embed_scale=float(config.get("embedding_multiplier", 1.0)),
            attention_scale=float(config.get("attention_multiplier", base.head_dim ** -0.5)),
            residual_multiplier=float(config.get("residual_multiplier", 1.0)),
            logits_divisor=float(config.get("logits_scaling", 1.0)),
        )
