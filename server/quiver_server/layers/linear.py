"""The one projection layer every attention and MLP matmul goes through.

A `Linear` may fuse several checkpoint projections into one matmul (q|k|v, gate|up): it keeps
each part's name and output width, so weights load per part and per-part adapter deltas can be
added to the matching output columns. It knows nothing of adapters: with adapter slots
allocated, a `layers.lora.LoraLinear` wraps it and adds them.

The shard's `KernelOps` decides once at load whether `pack_weight` (called once the checkpoint
is loaded) swaps the plain weight for a prepacked one (float32 on CPU, `kernels.cpu_gemm`).

Quantized (`quant/`): a part may load as a `QuantizedWeight` (a GGUF or pre-quantized checkpoint),
or `pack_weight(quantize=...)` quantizes the loaded float weight (`--quantize`); either way the
parts are joined into one quantized weight and packed for `kernels.quant_gemm`, and the float
weight is dropped. A Linear takes its parts all quantized or all float.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels import cpu_gemm, quant_gemm
from quiver_server.kernels.ops import KernelOps
from quiver_server.parallel import RowSpans, take_rows
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.quant.weights import QuantizedWeight, concat_rows
from quiver_server.weights import UnreadTensor, read_whole


class Linear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, ops: KernelOps) -> None:
        """parts: checkpoint projection name -> output width, in output-column order."""
        super().__init__()
        self.ops = ops
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = sum(parts.values())
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.part_columns = part_columns(self.parts)
        self.packed_weight: cpu_gemm.PackedWeight | None = None  # replaces `weight` once packed
        self.quant_weight: quant_gemm.PackedQuantWeight | None = None  # replaces `weight` when quantized
        self.quantized_parts: dict[str, QuantizedWeight] = {}  # pre-quantized parts, until packed
        # Tensor parallelism (models/tensor_split.py): the checkpoint rows of each part this rank
        # keeps (split by output), or the input columns (split by input, the bias on rank 0 only).
        # `whole_in_features`/`whole_parts`: the unsplit projection's, which adapters are made for.
        self.split_rows: dict[str, RowSpans] | None = None
        self.split_inputs: slice | None = None
        self.bias_here = True
        self.whole_in_features = in_features
        self.whole_parts = dict(self.parts)
        self._max_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    def split_by_output(self, rows: dict[str, RowSpans], whole_parts: dict[str, int]) -> None:
        self.split_rows, self.whole_parts = dict(rows), dict(whole_parts)

    def split_by_input(self, inputs: slice, whole_in_features: int, bias_here: bool,
                       max_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """max_over_ranks: the elementwise maximum of a tensor over the ranks (int8's row scales)."""
        self.split_inputs, self.whole_in_features, self.bias_here = inputs, whole_in_features, bias_here
        self._max_over_ranks = max_over_ranks

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, in] -> [T, out]. `batch` is for a LoRA wrapper's sake; the matmul ignores it."""
        del batch
        if self.quant_weight is not None:
            return quant_gemm.linear(x, self.quant_weight, self.bias)
        if self.packed_weight is not None:
            return cpu_gemm.linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_weight(self, quantize: QuantizeSpec | None = None) -> bool:
        """Replaces the plain weight by a prepacked one where the ops pack weights, or by the
        quantized one (pre-quantized parts, or `quantize` of the float weight);
        True if it did. Only after loading: `load_part` needs the plain weight."""
        if self.weight is None:
            return False
        if self.quantized_parts or quantize:
            self.quant_weight = self.ops.pack_quantized(self._quantized(quantize))
            self.quantized_parts = {}
            self.register_parameter("weight", None)
            return True
        packed = self.ops.pack(self.weight)
        if packed is None:
            return False
        self.packed_weight = packed
        self.register_parameter("weight", None)  # the packed copy is the only one kept
        return True

    def _quantized(self, quantize: QuantizeSpec | None) -> QuantizedWeight:
        if not self.quantized_parts:
            assert quantize is not None and self.weight is not None
            if self.split_inputs is None:
                return quantize.apply(self.weight.data)
            # A share of the whole rows: quantized as the whole rows are (their absmax, their groups).
            assert self._max_over_ranks is not None
            absmax = self._max_over_ranks(self.weight.data.detach().float().abs().amax(dim=1, keepdim=True))
            return quantize.apply(self.weight.data, absmax, self.whole_in_features)
        missing = [part for part in self.parts if part not in self.quantized_parts]
        if missing:
            raise ValueError(f"projections {missing} are not quantized like {list(self.quantized_parts)}: "
                             "a fused projection takes all its parts quantized or none")
        return concat_rows([self.quantized_parts[part] for part in self.parts])

    def load_part(self, part: str, kind: str, tensor: torch.Tensor | UnreadTensor | QuantizedWeight) -> None:
        """Copies a checkpoint tensor (`kind` "weight" or "bias" of projection `part`) into place;
        a quantized weight is kept aside until `pack_weight` joins the parts."""
        if self.weight is None:
            raise RuntimeError("weights are packed for serving; load before pack_weight")
        if part not in self.part_columns:
            raise ValueError(f"projection {part!r} is not one of {list(self.parts)}")
        if isinstance(tensor, QuantizedWeight):
            if self.split_rows is not None or self.split_inputs is not None:
                raise ValueError(f"{part}: quantized checkpoints are not split over shards yet; serve them with "
                                 "--num-shard 1 (--quantize on a float checkpoint splits)")
            start, end = self.part_columns[part]
            if kind != "weight" or (tensor.out_features, tensor.in_features) != (end - start, self.in_features):
                raise ValueError(f"{part}.{kind}: quantized {tensor.out_features}x{tensor.in_features}, "
                                 f"expected a {end - start}x{self.in_features} weight")
            self.quantized_parts[part] = tensor
            return
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a bias for {part!r} but the config says it has none")
        tensor = self._this_ranks(part, kind, tensor)
        start, end = self.part_columns[part]
        destination = target.data[start:end]
        if destination.shape != tensor.shape:
            raise ValueError(
                f"{part}.{kind} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
            )
        destination.copy_(tensor)

    def _this_ranks(self, part: str, kind: str, tensor: torch.Tensor | UnreadTensor) -> torch.Tensor:
        """The share of a whole checkpoint tensor this rank holds (all of it without splits),
        read from the checkpoint (only that share, where it is not read yet)."""
        if self.split_rows is not None:
            return take_rows(tensor, self.split_rows[part])
        if self.split_inputs is not None:
            if kind == "weight":
                return tensor[:, self.split_inputs]
            if not self.bias_here:
                return torch.zeros(tensor.shape)
        return read_whole(tensor)


def part_columns(parts: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each part's [start, end) output columns, the parts side by side in their order."""
    columns: dict[str, tuple[int, int]] = {}
    start = 0
    for name, width in parts.items():
        columns[name] = (start, start + width)
        start += width
    return columns
