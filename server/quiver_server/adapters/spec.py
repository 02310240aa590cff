"""What an adapter is checked against: the base model's LoRA-capable projections and shapes,
read from its family's `ProjectionLayout` (no model family is imported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quiver_server.models.family import ModelFamily, ProjectionLayout

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
    in_features: int
    out_features: int


@dataclass(frozen=True)
class BaseModelSpec:
    model_type: str
    num_layers: int
    layout: ProjectionLayout
    projections: dict[str, Projection]  # the LoRA targets (q_proj ... down_proj), in the order responses list them
    config: dict[str, Any]  # the base's config.json

    @classmethod
    def from_model(cls, model: ModelFamily, config: dict[str, Any]) -> BaseModelSpec:
        layout = model.layout
        projections = {}
        for name in layout.lora_targets:
            linear = layout.linear(model, 0, name)
            projections[name] = Projection(linear.in_features, linear.parts[name])
        return cls(
            model_type=str(config.get("model_type")),
            num_layers=model.config.num_layers,
            layout=layout,
            projections=projections,
            config=dict(config),
        )

    @property
    def non_lora_modules(self) -> tuple[str, ...]:
        """Module paths PEFT may name that we serve no LoRA on (embeddings, the output head)."""
        return self.layout.non_lora_modules

    def module_path(self, layer: int, name: str) -> str:
        """transformers' module path of a projection, as PEFT keys name it."""
        return self.layout.module_path(layer, name)

    def module_paths(self) -> dict[str, tuple[int, str]]:
        """Every LoRA-capable module path -> (layer, projection name)."""
        return {
            self.module_path(layer, name): (layer, name)
            for layer in range(self.num_layers)
            for name in self.projections
        }
