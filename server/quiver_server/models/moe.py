"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), computed as transformers does.

Routing: softmax of the router logits in float32, the top-k experts per token, optionally
renormalised to sum to one, the weights cast to the activation dtype or kept in float32
(`MoeConfig`). Experts: gated MLPs whose weights are stacked, gate|up [E, 2I, H] and down
[E, H, I]. The batch's (token, expert) pairs are sorted by expert and each projection runs as
one grouped matmul over all experts (`layers.grouped_linear`, on CPU and CUDA): no loop over
tokens, and where torch has the grouped kernel for the device and dtype, none over experts.

LoRA: the router is a `Linear` like any projection (LoRA target "gate"); the experts' projections
are the targets "experts.gate_proj", "experts.up_proj" and "experts.down_proj", each adapter
slot holding one A/B pair per expert. A (token, expert) pair reads the pair of its token's slot
and its expert, so requests on different adapters share every grouped matmul.

Checkpoints store each expert's projections apart (model.layers.N.mlp.experts.E.gate_proj);
they load into the stacks by expert index.

Split over tensor-parallel ranks (models/tensor_split.py), each rank holds every expert's slice of
the intermediate columns, the router whole: its sum over its experts is partial, and one
all-reduce of the layer's output (LoRA deltas included) completes it.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable

import torch
from torch import nn

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.activation import gated_activation
from quiver_server.layers.grouped_linear import GroupedLinear
from quiver_server.layers.linear import Linear
from quiver_server.models.decoder_config import DecoderConfig
from quiver_server.models.family import EXPERT_DOWN, EXPERT_GATE, EXPERT_UP, ROUTER
from quiver_server.parallel import SINGLE, TensorParallel
from quiver_server.weights import UnreadTensor

Loader = Callable[[torch.Tensor | UnreadTensor], None]


class SparseMoe(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: KernelOps, tp: TensorParallel = SINGLE,
                 split_rows: slice | None = None) -> None:
        """cfg: this rank's; split_rows: the checkpoint rows of each expert's gate/up it holds."""
        super().__init__()
        assert cfg.moe is not None
        self.tp = tp
        self.split_rows = split_rows
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.width = moe.intermediate_size
        self.normalize_top_k, self.weights_in_float32 = moe.normalize_top_k, moe.weights_in_float32
        width, experts = moe.intermediate_size, moe.num_experts
        self.gate = Linear(cfg.hidden_size, {ROUTER: experts}, bias=False, ops=ops)
        self.gate_up = GroupedLinear(experts, cfg.hidden_size, {EXPERT_GATE: width, EXPERT_UP: width}, ops)
        self.down = GroupedLinear(experts, width, {EXPERT_DOWN: cfg.hidden_size}, ops)
        self.act = gated_activation(cfg.activation, ops)
        if split_rows is not None:
            whole = width * tp.size
            self.gate_up.split_by_output({EXPERT_GATE: (split_rows,), EXPERT_UP: (split_rows,)},
                                         {EXPERT_GATE: whole, EXPERT_UP: whole})
            self.down.split_by_input(split_rows, whole)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        weights, experts = self.route(x, batch)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // self.top_k
        # A scatter-add, not bincount: bincount on CUDA reads the largest id back (a host sync,
        # which a CUDA graph cannot capture).
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        lora = self._pair_lora(batch.lora, token_of, flat_experts[order])
        hidden = self.gate_up(x[token_of], offsets, lora)
        out = self.down(self.act(hidden), offsets, lora)
        out = out * weights.reshape(-1)[order, None]
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, token_of, out.to(x.dtype)))

    def _pair_lora(self, lora: LoraBatchMeta | None, token_of: torch.Tensor,
                   expert_of: torch.Tensor) -> LoraBatchMeta | None:
        """The (token, expert) pairs' adapter buffer rows: slot * E + expert, -1 for base tokens
        (per rank class too, with several: each class's rows in its own buffers)."""
        if lora is None or not lora.has_lora:
            return None

        def rows_of(meta: LoraBatchMeta) -> torch.Tensor:
            slots = meta.token_slots[token_of]
            return torch.where(slots >= 0, slots * self.num_experts + expert_of, -1).to(torch.int32)

        pairs = LoraBatchMeta.for_class_rows(rows_of(lora), [rows_of(meta) for meta in lora.classes],
                                             [meta.max_rank for meta in lora.per_class()])
        # A class without tokens in this pass runs no kernel (in a graph every class has rows).
        classes = tuple(dataclasses.replace(pair, has_lora=meta.has_lora)
                        for pair, meta in zip(pairs.classes, lora.classes, strict=True))
        return dataclasses.replace(pairs, classes=classes) if classes else pairs

    def route(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k])."""
        logits = self.gate(x, batch)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return weights, experts

    def checkpoint_loaders(self, prefix: str) -> dict[str, Loader]:
        """Per-expert checkpoint names -> their rows of the stacks (this rank's slice of each
        expert's columns when split); the router as it is."""
        loaders: dict[str, Loader] = {
            f"{prefix}.gate.weight": lambda tensor: self.gate.load_part(ROUTER, "weight", tensor)
        }
        width = self.width
        gate_up, down = self.gate_up.weight, self.down.weight
        rows = self.split_rows or slice(None)
        for expert in range(self.num_experts):
            base = f"{prefix}.experts.{expert}"
            loaders[f"{base}.gate_proj.weight"] = _copy_into(gate_up[expert, :width], (rows,))
            loaders[f"{base}.up_proj.weight"] = _copy_into(gate_up[expert, width:], (rows,))
            loaders[f"{base}.down_proj.weight"] = _copy_into(down[expert], (slice(None), rows))
        return loaders


def _copy_into(destination: torch.Tensor, held: tuple[slice, ...]) -> Loader:
    """Copies the `held` part of a checkpoint tensor (all of it unsplit) into destination."""
    def load(tensor: torch.Tensor | UnreadTensor) -> None:
        tensor = tensor[held]
        if destination.shape != tensor.shape:
            raise ValueError(f"expert tensor has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
        destination.data.copy_(tensor)

    return load
