"""The sparse-MLP families on the shared decoder: Mixtral and Qwen3-MoE (`models/moe.py` has the
experts). LoRA serves on their attention projections, their routers and every expert."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, ClassVar

from quiver_server.models.decoder import DecoderForCausalLM
from quiver_server.models.decoder_config import (
    DecoderConfig,
    MoeConfig,
    common_config,
    projection_biases,
    uniform_windows,
)
from quiver_server.models.family import EXPERT_DOWN, EXPERT_GATE, EXPERT_UP, ExpertNaming, ProjectionLayout
from quiver_server.models.layouts import sparse
from quiver_server.models.llama import qwen_windows

# Mixtral checkpoints: block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
# Adapters trained on transformers 4 name the experts' Linears the checkpoint's way.
_MIXTRAL_EXPERTS = ExpertNaming(
    legacy_parent="block_sparse_moe", legacy_parts=(("w1", EXPERT_GATE), ("w3", EXPERT_UP), ("w2", EXPERT_DOWN)),
)


class MixtralForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = sparse(_MIXTRAL_EXPERTS)

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        base = common_config(config)
        moe = MoeConfig(
            num_experts=int(config["num_local_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=base.intermediate_size,
            normalize_top_k=True,
            weights_in_float32=True,
        )
        return replace(
            base,
            sliding_windows=uniform_windows(config, base.num_layers),
            moe=moe,
            moe_layers=(True,) * base.num_layers,
        )

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.", name)
        return name.replace(".block_sparse_moe.", ".mlp.")


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    layout: ClassVar[ProjectionLayout] = sparse(ExpertNaming())

    @classmethod
    def config_from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        base = common_config(config)
        num_layers = base.num_layers
        num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=int(config["num_experts_per_tok"]),
            intermediate_size=int(config["moe_intermediate_size"]),
            normalize_top_k=bool(config.get("norm_topk_prob", False)),
            weights_in_float32=False,
        )
        return replace(
            base,
            **projection_biases(config),
            qk_norm=True,
            sliding_windows=qwen_windows(config, num_layers),
            moe=moe,
            moe_layers=tuple(
                num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
            ),
        )
