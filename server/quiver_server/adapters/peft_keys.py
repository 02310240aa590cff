"""PEFT's tensor keys -> the (layer, projection) A/B pairs we serve, with each pair's own rank and
scaling (`rank_pattern`, `alpha_pattern`).

Three shapes of key reach the same pairs:

- a module's LoRA: `...layers.3.self_attn.q_proj.lora_A.weight`, A [r, in], B [out, r];
- a sparse MLP's experts as transformers 4 stored them, one Linear each
  (`...mlp.experts.5.gate_proj.lora_A.weight`, Mixtral `...block_sparse_moe.experts.5.w1...`):
  stacked here into A [E, r, in], B [E, out, r] (an expert the adapter leaves out stays zero);
- `target_parameters` on transformers 5's fused expert stacks: PEFT wraps the `experts` module
  once per parameter, nesting the wrappers (`experts.base_layer.lora_A` is the inner one), and
  keeps every expert's factors in one matrix, A [r*E, in] expert-major and B [out, r*E]
  rank-major. Which parameter a wrapper adapts is read off its shapes (gate|up takes H inputs
  and gives 2I outputs, down the reverse), so the nesting order does not matter; gate|up is
  split into our gate and up projections, both reading the same A.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quiver_server.adapters.peft_config import LoraConfig, targeted_parameters
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.bounded_text import clipped, shown

_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraWeight:
    """One projection's adapter: A [r, in] and B [out, r], or per expert [E, r, in] and
    [E, out, r]; `rank` and `scaling` as PEFT gives the module; `path` names it in messages."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int
    scaling: float
    path: str


LoraWeights = dict[tuple[int, str], LoraWeight]


def lora_weights(file_name: str, tensors: dict[str, torch.Tensor], spec: BaseModelSpec,
                 config: LoraConfig) -> LoraWeights:
    """Groups PEFT's tensors by (layer, projection); refuses tensors we would not apply."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ValueError(
                f"{file_name} holds {shown(key)}, which is not a LoRA A/B weight of a linear projection "
                "(DoRA, embedding LoRA, biases and modules_to_save are not supported)"
            )
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    modules, experts = spec.module_paths(), spec.expert_module_paths()
    parameters = targeted_parameters(config, spec)
    holders = {path.rpartition(".")[0] for path in parameters}
    weights: LoraWeights = {}
    per_expert: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor, str]]] = {}
    for module, found in sorted(halves.items()):
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise ValueError(f"{file_name} has no {missing} for {clipped(module)}")
        a, b = found["A"], found["B"]
        wrapped = module.replace(".base_layer", "")
        # Adapters trained on the bare backbone (no causal-LM head) lack the leading "model.".
        path = next((p for p in (wrapped, f"model.{wrapped}") if p in modules or p in holders), None)
        if path is None:
            raise ValueError(
                f"{file_name} has LoRA weights for {clipped(module)}, which is not a LoRA-capable module of this "
                f"{spec.model_type} model ({' '.join(spec.projections)} in layers 0..{spec.num_layers - 1})"
            )
        if path in experts:
            layer, name, expert = experts[path]
            per_expert.setdefault((layer, name), {})[expert] = (a, b, path)
        elif path in modules and wrapped == module:
            layer, name = modules[path]
            weights[(layer, name)] = LoraWeight(a, b, config.rank_for(path), config.scaling_for(path), path)
        else:
            weights.update(_fused_experts(file_name, module, a, b, path, parameters, spec, config))
    for (layer, name), by_expert in per_expert.items():
        weights[(layer, name)] = _stacked_experts(file_name, by_expert, spec.projections[name].experts, config)
    return weights


def _stacked_experts(file_name: str, by_expert: dict[int, tuple[torch.Tensor, torch.Tensor, str]],
                     num_experts: int, config: LoraConfig) -> LoraWeight:
    """transformers 4's per-expert Linears stacked by expert index; absent experts are zero."""
    first_a, first_b, path = next(iter(by_expert.values()))
    for a, b, expert_path in by_expert.values():
        if a.shape != first_a.shape or b.shape != first_b.shape:
            raise ValueError(f"{file_name}: {expert_path} has LoRA shapes {tuple(a.shape)}, {tuple(b.shape)}, "
                             f"other experts {tuple(first_a.shape)}, {tuple(first_b.shape)}")
    a_stack = first_a.new_zeros(num_experts, *first_a.shape)
    b_stack = first_b.new_zeros(num_experts, *first_b.shape)
    for expert, (a, b, _) in by_expert.items():
        a_stack[expert], b_stack[expert] = a, b
    stacked_path = re.sub(r"\.experts\.\d+\.", ".experts.*.", path)
    return LoraWeight(a_stack, b_stack, config.rank_for(path), config.scaling_for(path), stacked_path)


def _fused_experts(
    file_name: str, module: str, a: torch.Tensor, b: torch.Tensor, holder: str,
    parameters: dict[str, tuple[int, tuple[str, ...]]], spec: BaseModelSpec, config: LoraConfig,
) -> LoraWeights:
    """A `target_parameters` wrapper of `holder`: the targeted parameter whose shapes A and B
    fit, its factors regrouped per expert and its columns split into our projections."""
    candidates = {path: where for path, where in parameters.items() if path.rpartition(".")[0] == holder}
    expected = []
    for path, (layer, names) in candidates.items():
        projections = [spec.projections[name] for name in names]
        experts, in_features = projections[0].experts, projections[0].in_features
        out_features = sum(p.out_features for p in projections)
        rank = config.rank_for(path)
        shapes = ((rank * experts, in_features), (out_features, rank * experts))
        expected.append(f"{path}: lora_A {shapes[0]}, lora_B {shapes[1]}")
        if (tuple(a.shape), tuple(b.shape)) != shapes:
            continue
        # A: row e*r + k is expert e's rank component k. B: column k*E + e is expert e's column k.
        a_experts = a.reshape(experts, rank, in_features)
        b_experts = b.reshape(out_features, rank, experts).permute(2, 0, 1)
        out: LoraWeights = {}
        start = 0
        for name, projection in zip(names, projections, strict=True):
            end = start + projection.out_features
            out[(layer, name)] = LoraWeight(a_experts, b_experts[:, start:end], rank, config.scaling_for(path), path)
            start = end
        return out
    raise ValueError(
        f"{file_name} has LoRA weights for {module} of shapes lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}, "
        f"which fit none of the parameters target_parameters names there ({'; '.join(expected) or 'none'})"
    )
