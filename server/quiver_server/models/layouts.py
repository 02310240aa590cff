"""The projection layouts families share: how checkpoints (and PEFT) name the projections, and
which fused `Linear` of `models/decoder.py` computes each."""

from __future__ import annotations

from quiver_server.models.family import (
    EXPERT_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    ROUTER,
    ExpertNaming,
    FusedProjection,
    ProjectionLayout,
)

# PEFT could also target the embeddings and the output head, which we do not serve LoRA on.
NON_LORA_MODULES = ("model.embed_tokens", "lm_head")

# q, k, v and gate, up stored apart (Llama, Mistral, Qwen, Gemma, Granite); every one a LoRA target.
SEPARATE = ProjectionLayout(
    layers="model.layers",
    fused=(
        FusedProjection("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
        FusedProjection("self_attn", "o_proj", ("o_proj",)),
        FusedProjection("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
        FusedProjection("mlp", "down_proj", ("down_proj",)),
    ),
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    non_lora_modules=NON_LORA_MODULES,
)

# Phi-3's checkpoint stores qkv_proj and gate_up_proj fused; PEFT targets them as they are.
FUSED = ProjectionLayout(
    layers="model.layers",
    fused=(
        FusedProjection("self_attn", "qkv_proj", ("qkv_proj",)),
        FusedProjection("self_attn", "o_proj", ("o_proj",)),
        FusedProjection("mlp", "gate_up_proj", ("gate_up_proj",)),
        FusedProjection("mlp", "down_proj", ("down_proj",)),
    ),
    lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    non_lora_modules=NON_LORA_MODULES,
)

_ATTENTION = (
    FusedProjection("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedProjection("self_attn", "o_proj", ("o_proj",)),
)


def sparse(experts: ExpertNaming) -> ProjectionLayout:
    """Sparse-MLP models (models/moe.py): LoRA on attention, the router and every expert."""
    return ProjectionLayout(
        layers="model.layers",
        fused=(
            *_ATTENTION,
            FusedProjection("mlp", "gate", (ROUTER,)),
            FusedProjection("mlp", "gate_up", (EXPERT_GATE, EXPERT_UP)),
            FusedProjection("mlp", "down", (EXPERT_DOWN,)),
        ),
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", ROUTER, EXPERT_GATE, EXPERT_UP, EXPERT_DOWN),
        non_lora_modules=NON_LORA_MODULES,
        experts=experts,
    )
