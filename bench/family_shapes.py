"""The model-family block's models: random weights in a Qwen3-MoE and a Gemma 3 text shape,
written by transformers' `save_pretrained` with the bench tokenizer (bench_model.write_model).

Per device a pair of shapes: on CPU each about as heavy per token as the ~58M Llama of the main
block (a few minutes per family on 2 cores); on CUDA Qwen3-30B-A3B's and Gemma-3-4B's layer
widths with fewer layers; `tiny` for `--quick` smoke runs. Each shape also names what the
bench's adapters target on it, in peft's spelling: "all-linear" on the MoE model (current peft
then wraps the attention projections, the router and the fused experts, the last two through
`target_parameters`), and all seven projections on Gemma 3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import adapters
import bench_model

VOCAB_SIZE = 32000
# Below a request's 128 prompt + 64 generated tokens, so the local layers really slide.
SLIDING_WINDOW = 64


def gemma3_layer_types(layers: int) -> list[str]:
    """Gemma 3's 5:1 pattern: five sliding-window layers, then a global one."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


@dataclass(frozen=True)
class FamilyShape:
    name: str  # the model's directory under the model root
    family: str  # the report's key
    model_type: str  # transformers' model_type
    dtype: str
    config: dict[str, Any]  # the transformers config's fields
    target_modules: list[str] | str = field(default_factory=lambda: list(adapters.TARGET_MODULES))

    def transformers_config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type, vocab_size=VOCAB_SIZE, max_position_embeddings=4096, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, dtype=self.dtype, **self.config)


def _qwen3_moe(name: str, dtype: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
               experts: int, top_k: int, expert_width: int) -> FamilyShape:
    return FamilyShape(name, "qwen3_moe", "qwen3_moe", dtype, {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": expert_width,
        # Only a dense layer would use it (there is none): kept at the experts' total active width.
        "intermediate_size": top_k * expert_width, "norm_topk_prob": True, "tie_word_embeddings": False,
    }, target_modules="all-linear")


def _gemma3(name: str, dtype: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
            width: int) -> FamilyShape:
    return FamilyShape(name, "gemma3", "gemma3_text", dtype, {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
        "intermediate_size": width, "sliding_window": SLIDING_WINDOW, "layer_types": gemma3_layer_types(layers),
        "tie_word_embeddings": True,  # as Gemma 3 ships
    })


SHAPES: dict[str, tuple[FamilyShape, ...]] = {
    "cpu": (
        _qwen3_moe("qwen3-moe-cpu", "float32", layers=6, hidden=512, heads=8, kv_heads=2, head_dim=64,
                   experts=16, top_k=4, expert_width=256),
        _gemma3("gemma3-cpu", "float32", layers=6, hidden=512, heads=4, kv_heads=1, head_dim=128, width=3072),
    ),
    "cuda": (
        # Qwen3-30B-A3B's layer (48 of them there).
        _qwen3_moe("qwen3-moe-30b-a3b-layers", "bfloat16", layers=6, hidden=2048, heads=32, kv_heads=4,
                   head_dim=128, experts=128, top_k=8, expert_width=768),
        # Gemma-3-4B's layer (34 of them there).
        _gemma3("gemma3-4b-layers", "bfloat16", layers=12, hidden=2560, heads=8, kv_heads=4, head_dim=256,
                width=10240),
    ),
    "tiny": (
        _qwen3_moe("qwen3-moe-tiny", "float32", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                   experts=8, top_k=2, expert_width=64),
        _gemma3("gemma3-tiny", "float32", layers=6, hidden=128, heads=4, kv_heads=1, head_dim=32, width=512),
    ),
}


def ensure_model(shape: FamilyShape, root: Path, device: str) -> Path:
    """Writes the model once under `root/<shape name>` and returns its directory."""
    return bench_model.write_model(shape.transformers_config(), shape.dtype, root / shape.name, device,
                                   json.loads(json.dumps(asdict(shape))))


def describe(shape: FamilyShape) -> dict:
    """The shape for the report, with its parameter count and, for an MoE, the parameters one
    token runs through (the routed share of the experts)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.transformers_config())
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    row: dict[str, Any] = {"name": shape.name, "model_type": shape.model_type, "dtype": shape.dtype,
                           "weights": "random", "vocab_size": VOCAB_SIZE, **shape.config, "parameters": total}
    if experts:
        routed = shape.config["num_experts_per_tok"] / shape.config["num_experts"]
        row["active_parameters_per_token"] = round(total - experts * (1 - routed))
    return row
