"""What an adapter is checked against: the base model's LoRA-capable projections and shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quiver_server.models.llama import LORA_PROJECTIONS, NON_LORA_MODULES, LlamaForCausalLM

# The projections in the order responses list them.
PROJECTION_ORDER = tuple(LORA_PROJECTIONS)

# config.json keys whose values must agree between the base an adapter was trained on (when
# its adapter_config.json points at a local copy of it) and the base being served.
SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


@dataclass(frozen=True)
class Projection:
    parent: str  # transformers module it sits under: "self_attn" or "mlp"
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseModelSpec:
    model_type: str
    num_layers: int
    projections: dict[str, Projection]  # q_proj ... down_proj
    non_lora_modules: tuple[str, ...]  # module paths PEFT may name that we serve no LoRA on
    config: dict[str, Any]  # the base's config.json

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, config: dict[str, Any]) -> BaseModelSpec:
        projections = {}
        for name, parent in LORA_PROJECTIONS.items():
            linear = model.projection(0, name)
            projections[name] = Projection(parent, linear.in_features, linear.parts[name])
        return cls(
            model_type=str(config.get("model_type")),
            num_layers=model.config.num_layers,
            projections=projections,
            non_lora_modules=NON_LORA_MODULES,
            config=dict(config),
        )

    def module_path(self, layer: int, name: str) -> str:
        """transformers' module path of a projection, as PEFT keys name it."""
        return f"model.layers.{layer}.{self.projections[name].parent}.{name}"

    def module_paths(self) -> dict[str, tuple[int, str]]:
        """Every LoRA-capable module path -> (layer, projection name)."""
        return {
            self.module_path(layer, name): (layer, name)
            for layer in range(self.num_layers)
            for name in self.projections
        }
