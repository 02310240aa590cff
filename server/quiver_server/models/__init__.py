"""Model registry: config.json's `model_type` -> the family implementation that serves it.

A family is a torch module with `config` (vocab_size, num_layers, num_kv_heads, head_dim,
max_position_embeddings), `forward(input_ids, batch, kv_cache) -> logits`, and a classmethod
`load(model_dir, config, dtype, device)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quiver_server.models import llama

MODEL_FAMILIES: dict[str, type[llama.LlamaForCausalLM]] = {
    model_type: llama.LlamaForCausalLM for model_type in llama.MODEL_TYPES
}


def family_for(config: dict[str, Any]) -> type[llama.LlamaForCausalLM]:
    model_type = config.get("model_type")
    family = MODEL_FAMILIES.get(str(model_type))
    if family is None:
        supported = ", ".join(sorted(MODEL_FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")
    return family


def load_model(
    model_dir: Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> llama.LlamaForCausalLM:
    return family_for(config).load(Path(model_dir), config, dtype, device)
