"""Model registry: config.json's `model_type` -> the family implementation that serves it.

A family (`family.ModelFamily`) is a torch module with `config` (vocab_size, num_layers,
num_kv_heads, head_dim, max_position_embeddings), `forward(input_ids, batch, kv_cache) -> logits`,
a classmethod `load(model_dir, config, dtype, ops)`, and a `layout` of its projections
(`family.ProjectionLayout`) that the adapter code reads. Every family here is a
`decoder.DecoderForCausalLM` that declares its pieces; adding one is a small file and an entry
here (docs/models.md lists them with what is tested).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quiver_server.kernels.ops import KernelOps, select_ops
from quiver_server.models import gemma, granite, llama, mixture, phi3
from quiver_server.models.family import ModelFamily
from quiver_server.parallel import SINGLE, TensorParallel
from quiver_server.quant.quantize import QuantizeSpec

MODEL_FAMILIES: dict[str, type[ModelFamily]] = {
    **{model_type: llama.LlamaForCausalLM for model_type in llama.MODEL_TYPES},
    **{model_type: gemma.GemmaForCausalLM for model_type in gemma.MODEL_TYPES},
    **{model_type: phi3.Phi3ForCausalLM for model_type in phi3.MODEL_TYPES},
    **{model_type: granite.GraniteForCausalLM for model_type in granite.MODEL_TYPES},
    "mixtral": mixture.MixtralForCausalLM,
    "qwen3_moe": mixture.Qwen3MoeForCausalLM,
}


def family_for(config: dict[str, Any]) -> type[ModelFamily]:
    model_type = config.get("model_type")
    family = MODEL_FAMILIES.get(str(model_type))
    if family is None:
        supported = ", ".join(sorted(MODEL_FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")
    return family


def load_model(
    model_dir: Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device, ops: KernelOps | None = None,
    quantize: QuantizeSpec | None = None, tp: TensorParallel = SINGLE,
) -> ModelFamily:
    """The model on `device`, running `ops` (by default `select_ops(device)`: the shard passes its
    own), its projections quantized at load if `quantize` says so, this rank's share of it when
    `tp` splits it over ranks."""
    if ops is None:
        ops = select_ops(device)
    elif ops.device != device:
        raise ValueError(f"ops for {ops.device} cannot run a model on {device}")
    return family_for(config).load(Path(model_dir), config, dtype, ops, quantize, tp)
