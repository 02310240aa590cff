"""FP8 checkpoints (float8 e4m3 weights with float scales), as llm-compressor writes them
(`quant_method: compressed-tensors`, format `float-quantized`) and as transformers' fine-grained
FP8 does (`quant_method: fp8`, Qwen's and DeepSeek's own FP8 releases): each quantized
projection's weight is dequantized at load, w = q * scale in float32, and the model serves it in
its dtype.

Scales, by the config's weight strategy:
- `channel`: weight_scale [out, 1], one scale per output row;
- `tensor`: weight_scale of one element;
- `block` (compressed-tensors `block_structure`, or fp8's `weight_block_size`): weight_scale, or
  fp8's weight_scale_inv (multiplied, as its name notwithstanding the reference code does),
  [ceil(out / b0), ceil(in / b1)], one scale per b0 x b1 tile.

What this does not do, said where it is documented (docs/quantization.md): keep the weights in
8 bits (they take the model dtype's bytes: no CPU or Triton kernel here multiplies float8), or
quantize the activations as the checkpoint's `input_activations` ask (dynamic per-token, or
static with an input_scale, which is read and dropped): activations stay in the model dtype, as
with weight-only FP8 on GPUs without FP8 units. Refused, naming what is served: integer or
packed compressed-tensors formats, other bit widths or float formats, group strategies, and
checkpoints whose schemes disagree between config groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quiver_server.quant.weights import QuantizedWeight

SUPPORTED = ("FP8 e4m3 weights with per-channel, per-tensor or block scales (compressed-tensors "
             "float-quantized, or quant_method fp8)")
# Every float8 torch reads from safetensors: a weight in any of them is a quantized projection's
# (served only as e4m3fn, what the configs above declare), never a float tensor to load as it is.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_SCALES = ("weight_scale", "weight_scale_inv")
_DROPPED = ("input_scale", "input_scale_inv")  # static activation scales: activations stay unquantized


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "compressed-tensors" or "fp8"
    strategy: str  # "channel", "tensor" or "block"
    block: tuple[int, int] | None = None  # (rows, columns) of a scale's tile for "block"


def fp8_format(qc: Mapping[str, Any], method: str) -> Fp8Format:
    """The FP8 scheme a quantization_config declares; a ValueError naming what does not fit."""
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported; quiver serves {SUPPORTED}")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Format("fp8", "tensor")
        return Fp8Format("fp8", "block", _block(block))
    fmt = str(qc.get("format", "")).lower()
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; quiver serves {SUPPORTED}")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = {_weight_scheme(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ValueError("compressed-tensors config groups with different weight schemes "
                         f"({sorted(map(str, schemes))}) are not supported")
    strategy, block = schemes.pop()
    return Fp8Format("compressed-tensors", strategy, block)


def _weight_scheme(name: str, group: Any) -> tuple[str, tuple[int, int] | None]:
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping):
        raise ValueError(f"compressed-tensors config group {name!r} has no weights scheme")
    kind, bits = str(weights.get("type", "")).lower(), weights.get("num_bits")
    if kind != "float" or bits != 8:
        raise ValueError(f"compressed-tensors weights of type {kind!r} with {bits!r} bits are not supported; "
                         f"quiver serves {SUPPORTED}")
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    strategy = str(weights.get("strategy", "")).lower()
    if strategy == "block":
        return strategy, _block(weights.get("block_structure"))
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported; quiver serves {SUPPORTED}")
    return strategy, None


def _block(block: Any) -> tuple[int, int]:
    if (not isinstance(block, Sequence) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"an FP8 block size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize(module: str, q: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """w = q * scale in float32, scale spread over its row, the whole tensor or its tile."""
    if q.dim() != 2:
        raise ValueError(f"{module}.weight must be 2-D, got shape {tuple(q.shape)}")
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight is {q.dtype}; FP8 checkpoints are served in e4m3 (float8_e4m3fn)")
    out, inp = q.shape
    s = scale.to(torch.float32)
    if fmt.strategy == "tensor":
        if s.numel() != 1:
            raise ValueError(f"{module}: a per-tensor scale has one element, got shape {tuple(scale.shape)}")
        return q.to(torch.float32) * s.reshape(())
    if fmt.strategy == "channel":
        if s.numel() != out:
            raise ValueError(f"{module}: a per-channel scale has {out} elements, got shape {tuple(scale.shape)}")
        return q.to(torch.float32) * s.reshape(out, 1)
    assert fmt.block is not None
    rows, cols = fmt.block
    tiles = (-(-out // rows), -(-inp // cols))
    if tuple(s.shape) != tiles:
        raise ValueError(f"{module}: block scales of {rows} x {cols} tiles must have shape {tiles}, "
                         f"got {tuple(scale.shape)}")
    spread = s.repeat_interleave(rows, dim=0)[:out].repeat_interleave(cols, dim=1)[:, :inp]
    return q.to(torch.float32) * spread


def dequantized_fp8_tensors(
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], fmt: Fp8Format,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each float8 `<module>.weight` and its scale joined into one
    float32 `<module>.weight`, yielded once both have come (in any order, across files); static
    input scales dropped; everything else as it comes."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, piece = name.rpartition(".")
        if piece in _DROPPED:
            continue
        is_fp8 = isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES
        if not module or not (piece in _SCALES or (piece == "weight" and is_fp8)):
            if is_fp8:
                raise ValueError(f"{name} is float8 but no quantized projection's weight")
            yield name, tensor
            continue
        assert isinstance(tensor, torch.Tensor)
        pieces = pending.setdefault(module, {})
        key = "weight" if piece == "weight" else "scale"
        if key in pieces:
            raise ValueError(f"{module} has more than one {'weight' if key == 'weight' else 'scale'} in the checkpoint")
        pieces[key] = tensor
        if pieces.keys() == {"weight", "scale"}:
            yield f"{module}.weight", dequantize(module, pieces["weight"], pending.pop(module)["scale"], fmt)
    if pending:
        listed = "; ".join(f"{module} lacks its {'scale' if 'weight' in pieces else 'float8 weight'}"
                           for module, pieces in sorted(pending.items()))
        raise ValueError(f"incomplete FP8 modules in the checkpoint: {listed}")
