"""What generic code needs of a model family: the adapters read its projections from a
`ProjectionLayout`, the engine drives it through `ModelFamily`. A new family declares both in
its own model file and adds a registry entry (`models/__init__.py`); nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from quiver_server.forward_batch import ForwardBatch
from quiver_server.kernels.ops import KernelOps
from quiver_server.kv_cache import PagedKVCache
from quiver_server.layers.linear import Linear


@dataclass(frozen=True)
class FusedProjection:
    """Checkpoint projections that one `Linear` computes in a single matmul (q|k|v, gate|up, or
    a single projection), its output columns in `parts` order."""

    parent: str  # the module inside a decoder layer that holds them: "self_attn"
    linear: str  # the fused Linear's name under `parent`: "qkv_proj"
    parts: tuple[str, ...]  # checkpoint (and PEFT) names: ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class ProjectionLayout:
    """Where a family's projections sit, as checkpoints and PEFT name them (model.layers.3.
    self_attn.q_proj) and as the model fuses them (model.layers.3.self_attn.qkv_proj)."""

    layers: str  # module path of the decoder layers: "model.layers"
    fused: tuple[FusedProjection, ...]
    lora_targets: tuple[str, ...]  # projections LoRA may target, in the order responses list them
    non_lora_modules: tuple[str, ...]  # module paths PEFT may target that get no LoRA here
    _by_part: dict[str, FusedProjection] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_part = {part: fused for fused in self.fused for part in fused.parts}
        unknown = [name for name in self.lora_targets if name not in by_part]
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not projections of this layout")
        object.__setattr__(self, "_by_part", by_part)

    @property
    def fused_into(self) -> dict[str, str]:
        """Checkpoint projection name -> the fused Linear (a sibling module) that holds it."""
        return {part: fused.linear for part, fused in self._by_part.items()}

    def module_path(self, layer: int, name: str) -> str:
        """transformers' module path of projection `name` in layer `layer`, as PEFT keys name it."""
        return f"{self.layers}.{layer}.{self._by_part[name].parent}.{name}"

    def linear(self, model: ModelFamily, layer: int, name: str) -> Linear:
        """The (possibly fused) Linear of `model` that computes projection `name` in layer
        `layer`; its `part_columns[name]` are that projection's output columns."""
        fused = self._by_part[name]
        module = model.get_submodule(f"{self.layers}.{layer}.{fused.parent}.{fused.linear}")
        assert isinstance(module, Linear)
        return module


class ModelShape(Protocol):
    """The config fields the engine sizes the KV cache and validates requests with."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...


class ModelFamily(Protocol):
    """A served model: a torch module whose forward maps a flattened batch to logits."""

    layout: ClassVar[ProjectionLayout]

    @property
    def config(self) -> ModelShape: ...

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] -> logits [len(batch.logits_indices), vocab]."""
        ...

    def get_submodule(self, target: str) -> nn.Module: ...

    @classmethod
    def load(cls, model_dir: Path, config: dict[str, Any], dtype: torch.dtype, ops: KernelOps) -> ModelFamily:
        """The model of config.json `config` with the checkpoint in `model_dir`, on `ops.device`."""
        ...
