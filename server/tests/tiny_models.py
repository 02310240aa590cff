"""Tiny random-weight models of each supported architecture, written with transformers'
`save_pretrained` — the independent reference every parity test compares against.

    from tiny_models import build_tiny_model
    path = build_tiny_model(tmp_path / "llama", "llama")  # also "mistral", "qwen2"

Weights are drawn with a larger spread than transformers' default init (and norms and biases
are randomised too), so logits are far from ties and every parameter matters: greedy parity is
then a sharp test instead of a coin flip between near-equal logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHITECTURES = ("llama", "mistral", "qwen2")

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_tiny_model(
    dir: str | Path,
    arch: str,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Writes a float32 model of architecture `arch` into `dir` (created if needed); returns it.
    `max_shard_size` (e.g. "100KB") writes sharded safetensors with an index; `config_overrides`
    go to the transformers config (e.g. sliding_window=8 for mistral)."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    config_cls, model_cls = _CONFIGS[arch]
    config = config_cls(**{**TINY_SHAPE, "tie_word_embeddings": tie_word_embeddings, **config_overrides})
    generator = torch.Generator().manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return path
