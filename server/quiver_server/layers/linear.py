"""The one projection layer every attention and MLP matmul goes through.

A `Linear` may fuse several checkpoint projections into one matmul (q|k|v, gate|up): it keeps
each part's name and output width, so weights load per part and per-part adapter deltas can be
added to the matching output columns. Multi-LoRA (issue 3) hooks in at `Linear.forward`, which
already receives the forward batch (where per-token adapter indices will live).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quiver_server.forward_batch import ForwardBatch


class Linear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        """parts: checkpoint projection name -> output width, in output-column order."""
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = sum(parts.values())
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, width in self.parts.items():
            offsets[name] = (start, start + width)
            start += width
        self.part_columns = offsets

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # Issue 3: `+ lora_delta(x, batch)` per part goes here.
        del batch
        return F.linear(x, self.weight, self.bias)

    def load_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """Copies a checkpoint tensor (`kind` "weight" or "bias" of projection `part`) into place."""
        if part not in self.part_columns:
            raise ValueError(f"projection {part!r} is not one of {list(self.parts)}")
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a bias for {part!r} but the config says it has none")
        start, end = self.part_columns[part]
        destination = target.data[start:end]
        if destination.shape != tensor.shape:
            raise ValueError(
                f"{part}.{kind} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
            )
        destination.copy_(tensor)
