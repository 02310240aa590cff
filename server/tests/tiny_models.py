"""Tiny random-weight models of each supported architecture, written with transformers'
`save_pretrained` — the independent reference every parity test compares against.

    from tiny_models import build_tiny_model
    path = build_tiny_model(tmp_path / "llama", "llama")  # or any of ARCHITECTURES

Weights are drawn with a larger spread than transformers' default init (and norms and biases
are randomised too), so logits are far from ties and every parameter matters: greedy parity is
then a sharp test instead of a coin flip between near-equal logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
}
ARCHITECTURES = tuple(_CONFIGS)

# Per architecture, what the tiny shape needs on top of TINY_SHAPE: heads of 16 where the
# family's default head_dim is wider, small experts, a pad token inside the tiny vocabulary.
_ARCH_SHAPE: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "pad_token_id": 0},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "pad_token_id": 0},
    "phi3": {"pad_token_id": 0},
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
    base_model: bool = False,
    **config_overrides: Any,
) -> Path:
    """Writes a float32 model of architecture `arch` into `dir` (created if needed); returns it.
    `max_shard_size` (e.g. "100KB") writes sharded safetensors with an index; `base_model`: the
    bare backbone (`AutoModel`: Qwen3Model, MistralModel), saved without an LM head and without
    the `model.` prefix, as decoder embedding models are; `config_overrides` go to the
    transformers config (e.g. sliding_window=8 for mistral)."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    config_cls, model_cls = _CONFIGS[arch]
    config = config_cls(**{**TINY_SHAPE, **_ARCH_SHAPE.get(arch, {}), "tie_word_embeddings": tie_word_embeddings,
                           **config_overrides})
    generator = torch.Generator().manual_seed(seed)
    model = (transformers.AutoModel.from_config(config) if base_model else model_cls(config)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): around 0 there, around 1 elsewhere.
                param.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.1 * noise)
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
