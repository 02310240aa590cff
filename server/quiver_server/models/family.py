"""What generic code needs of a model family: the adapters read its projections from a
`ProjectionLayout`, the engine drives it through `ModelFamily`. A new family declares both in
its own model file and adds a registry entry (`models/__init__.py`); nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels.ops import KernelOps
from quiver_server.kernels.quant_gemm import PackedQuantWeight
from quiver_server.engine.kv_cache import PagedKVCache
from quiver_server.parallel import SINGLE, TensorParallel
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.layers.grouped_linear import GroupedLinear
from quiver_server.layers.linear import Linear
from quiver_server.layers.lora import LoraWrapper


@dataclass(frozen=True)
class FusedProjection:
    """Checkpoint projections that one `Linear` computes in a single matmul (q|k|v, gate|up, or
    a single projection), its output columns in `parts` order."""

    parent: str  # the module inside a decoder layer that holds them: "self_attn"
    linear: str  # the fused Linear's name under `parent`: "qkv_proj"
    parts: tuple[str, ...]  # checkpoint (and PEFT) names: ("q_proj", "k_proj", "v_proj")


# A sparse MLP's LoRA targets: its router, and its experts' projections, each stacked over the
# experts (models/moe.py). Their names as adapters know them vary with the transformers release
# the adapter was trained on; `ExpertNaming` maps them.
ROUTER = "gate"
EXPERT_GATE, EXPERT_UP, EXPERT_DOWN = "experts.gate_proj", "experts.up_proj", "experts.down_proj"


@dataclass(frozen=True)
class ExpertNaming:
    """How PEFT names a sparse MLP's LoRA targets. transformers 5 stores the experts as fused 3-D
    parameters (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj) that PEFT targets
    with `target_parameters`; transformers 4 had one Linear per expert (mlp.experts.3.gate_proj;
    Mixtral: block_sparse_moe.experts.3.w1) that `target_modules` named."""

    parent: str = "mlp"  # the module in a decoder layer holding `gate` and `experts`
    legacy_parent: str = "mlp"  # its transformers 4 name
    # transformers 4's per-expert Linear names -> our targets
    legacy_parts: tuple[tuple[str, str], ...] = (
        ("gate_proj", EXPERT_GATE), ("up_proj", EXPERT_UP), ("down_proj", EXPERT_DOWN),
    )
    # transformers 5's fused expert parameters -> our targets, in their column order
    parameters: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("gate_up_proj", (EXPERT_GATE, EXPERT_UP)), ("down_proj", (EXPERT_DOWN,)),
    )

    def expert_modules(self, layer_path: str, num_experts: int) -> dict[str, tuple[str, int]]:
        """transformers 4 per-expert module paths of one layer -> (target, expert)."""
        return {
            f"{layer_path}.{self.legacy_parent}.experts.{expert}.{module}": (target, expert)
            for expert in range(num_experts)
            for module, target in self.legacy_parts
        }

    def router_modules(self, layer_path: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f"{layer_path}.{parent}.gate" for parent in (self.parent, self.legacy_parent)))

    def expert_parameters(self, layer_path: str) -> dict[str, tuple[str, ...]]:
        """transformers 5 fused parameter paths of one layer -> the targets each covers."""
        return {f"{layer_path}.{self.parent}.experts.{name}": targets for name, targets in self.parameters}


@dataclass(frozen=True)
class ProjectionLayout:
    """Where a family's projections sit, as checkpoints and PEFT name them (model.layers.3.
    self_attn.q_proj) and as the model fuses them (model.layers.3.self_attn.qkv_proj)."""

    layers: str  # module path of the decoder layers: "model.layers"
    fused: tuple[FusedProjection, ...]
    lora_targets: tuple[str, ...]  # projections LoRA may target, in the order responses list them
    non_lora_modules: tuple[str, ...]  # module paths PEFT may target that get no LoRA here
    experts: ExpertNaming | None = None  # sparse MLPs: how adapters name their router and experts
    _by_part: dict[str, FusedProjection] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_part = {part: fused for fused in self.fused for part in fused.parts}
        unknown = [name for name in self.lora_targets if name not in by_part]
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not projections of this layout")
        object.__setattr__(self, "_by_part", by_part)

    def module_path(self, layer: int, name: str) -> str:
        """transformers' module path of projection `name` in layer `layer`, as PEFT keys name it."""
        return f"{self.layers}.{layer}.{self._by_part[name].parent}.{name}"

    def layer_path(self, layer: int, name: str) -> str:
        """Module path of the (possibly fused) layer that computes projection `name` in `layer`."""
        fused = self._by_part[name]
        return f"{self.layers}.{layer}.{fused.parent}.{fused.linear}"

    def linear(self, model: ModelFamily, layer: int, name: str) -> Linear | GroupedLinear | None:
        """The (possibly fused) layer of `model` that computes projection `name` in layer
        `layer`, under any LoRA wrapper (None where that layer has none: the dense layers of a
        sparse model); its `part_columns[name]` are that projection's output columns."""
        try:
            module = model.get_submodule(self.layer_path(layer, name))
        except AttributeError:
            return None
        if isinstance(module, LoraWrapper):
            module = module.base
        return module if isinstance(module, (Linear, GroupedLinear)) else None


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
    @property
    def hidden_size(self) -> int: ...
    @property
    def has_lm_head(self) -> bool: ...


class ModelFamily(Protocol):
    """A served model: a torch module whose forward maps a flattened batch to logits."""

    layout: ClassVar[ProjectionLayout]

    @property
    def config(self) -> ModelShape: ...

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] -> logits [len(batch.logits_indices), vocab]."""
        ...

    def hidden_states(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids [T] -> every token's last hidden state after the final norm [T, hidden]
        (what embeddings are pooled from); the K/V are written as by a prefill."""
        ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def quantized_weights(self) -> list[PackedQuantWeight]:
        """The packed quantized weights: every quantized projection's, and the LM head's."""
        ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    @classmethod
    def load(
        cls, model_dir: Path, config: dict[str, Any], dtype: torch.dtype, ops: KernelOps,
        quantize: QuantizeSpec | None = None, tp: TensorParallel = SINGLE,
    ) -> ModelFamily:
        """The model of config.json `config` with the checkpoint in `model_dir`, on `ops.device`;
        `quantize`: its projections quantized at load (`quant.quantize`); `tp`: this rank's share
        of a model split over ranks (`models.tensor_split`)."""
        ...
