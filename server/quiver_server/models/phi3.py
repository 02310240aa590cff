"""Phi-3 and Phi-4 (`model_type` phi3, including Phi-3.5 and Phi-4-mini) on the shared decoder:
the checkpoint's fused qkv_proj and gate_up_proj load as they are (and PEFT adapters target them
so), LongRoPE and partial rotary come from the rope config, and a configured sliding window
applies to every layer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.models.decoder_config import DecoderConfig, common_config, uniform_windows
from quiver_server.models.family import ProjectionLayout
from quiver_server.models.layouts import FUSED

MODEL_TYPES = ("phi3",)


class Phi3ForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = FUSED

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        base = common_config(config)
        return replace(base, fused_checkpoint=True, sliding_windows=uniform_windows(config, base.num_layers))
