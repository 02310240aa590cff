"""What an adapter is checked against: the base model's LoRA-capable projections and shapes,
read from its family's `ProjectionLayout` (no model family is imported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quiver_server.models.family import EXPERT_GATE, ROUTER, ModelFamily, ProjectionLayout

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
    experts: int = 1  # A/B pairs per adapter: one per expert for a sparse MLP's expert projections


@dataclass(frozen=True)
class BaseModelSpec:
    model_type: str
    num_layers: int
    layout: ProjectionLayout
    projections: dict[str, Projection]  # the LoRA targets (q_proj ... down_proj), in the order responses list them
    config: dict[str, Any]  # the base's config.json
    present: frozenset[tuple[int, str]]  # (layer, projection) pairs the model has

    @classmethod
    def from_model(cls, model: ModelFamily, config: dict[str, Any]) -> BaseModelSpec:
        layout = model.layout
        projections: dict[str, Projection] = {}
        present = set()
        for layer in range(model.config.num_layers):
            for name in layout.lora_targets:
                linear = layout.linear(model, layer, name)
                if linear is None:
                    continue
                present.add((layer, name))
                # The unsplit projection's shape (layers.linear: a rank of a split model holds a
                # share), which is what an adapter is trained for.
                projections.setdefault(
                    name, Projection(getattr(linear, "whole_in_features", linear.in_features),
                                     getattr(linear, "whole_parts", linear.parts)[name],
                                     getattr(linear, "num_experts", 1))
                )
        return cls(
            model_type=str(config.get("model_type")),
            num_layers=model.config.num_layers,
            layout=layout,
            projections={name: projections[name] for name in layout.lora_targets if name in projections},
            config=dict(config),
            present=frozenset(present),
        )

    @property
    def non_lora_modules(self) -> tuple[str, ...]:
        """Module paths PEFT may name that we serve no LoRA on (embeddings, the output head)."""
        return self.layout.non_lora_modules

    def module_path(self, layer: int, name: str) -> str:
        """transformers' module path of a projection, as PEFT keys name it."""
        return self.layout.module_path(layer, name)

    def module_paths(self) -> dict[str, tuple[int, str]]:
        """Every LoRA-capable module path PEFT's `target_modules` may name -> (layer, projection
        name); a sparse MLP's experts under their per-expert transformers 4 paths."""
        experts = self.layout.experts
        paths = {}
        for layer, name in sorted(self.present):
            if experts is not None and name.startswith("experts."):
                continue
            paths[self.module_path(layer, name)] = (layer, name)
            if experts is not None and name == ROUTER:
                paths.update(dict.fromkeys(experts.router_modules(self._layer_path(layer)), (layer, name)))
        for path, (layer, name, _) in self.expert_module_paths().items():
            paths[path] = (layer, name)
        return paths

    def expert_module_paths(self) -> dict[str, tuple[int, str, int]]:
        """A sparse MLP's per-expert module paths (transformers 4) -> (layer, projection, expert)."""
        experts = self.layout.experts
        if experts is None:
            return {}
        paths = {}
        for layer in sorted({layer for layer, name in self.present if name.startswith("experts.")}):
            count = self.projections[EXPERT_GATE].experts
            for path, (name, expert) in experts.expert_modules(self._layer_path(layer), count).items():
                paths[path] = (layer, name, expert)
        return paths

    def parameter_paths(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Parameter paths PEFT's `target_parameters` may name -> (layer, the projections the
        parameter holds): each projection's weight, and a sparse MLP's fused expert stacks."""
        paths: dict[str, tuple[int, tuple[str, ...]]] = {}
        for layer, name in sorted(self.present):
            if not name.startswith("experts."):
                paths[f"{self.module_path(layer, name)}.weight"] = (layer, (name,))
        experts = self.layout.experts
        if experts is not None:
            for layer in sorted({layer for layer, name in self.present if name.startswith("experts.")}):
                for path, names in experts.expert_parameters(self._layer_path(layer)).items():
                    paths[path] = (layer, names)
        return paths

    def _layer_path(self, layer: int) -> str:
        return f"{self.layout.layers}.{layer}"
