"""Pre-quantized AWQ and GPTQ checkpoints (as AutoAWQ, AutoGPTQ, GPTQModel and optimum write them,
with `quantization_config` in config.json): each quantized module's packed tensors as one
`QuantizedWeight`, exactly.

Both formats define w = (q - zero) * scale per group of `group_size` inputs, in int32 words whose
field j holds bits [bits * j, bits * (j + 1)):

- AWQ GEMM (4-bit): qweight [in, out/8] packs 8 output columns a word, column 8c + AWQ_ORDER[j] in
  field j; qzeros [in/group, out/8] the same way; scales [in/group, out].
- GPTQ (4- or 8-bit): qweight [in*bits/32, out] packs consecutive inputs along the input, in plain
  order; qzeros [in/group, out*bits/32] consecutive outputs along the output; scales
  [in/group, out]; g_idx [in] each input's group. checkpoint_format "gptq" (v1) stores each zero
  point minus one, "gptq_v2" the zero point itself.

A zero point becomes the offset -scale * zero (8-bit: q is recentred to int8, see
`_gptq_weight`), so w = q * scale + offset; with 16-bit scales and small integer zeros every
product and the sum are exact in float32.

Refused, with a message saying so: AWQ other than 4-bit GEMM with zero points (GEMV, GEMV-fast,
exllama, marlin, llm-awq and ipex pack differently); 2- and 3-bit GPTQ; GPTQ in marlin, bitblas or
other repacked formats; GPTQModel's `dynamic` per-module bits or group sizes; and act-order
(desc_act) checkpoints whose g_idx reorders the inputs' groups: a QuantizedWeight keeps each group
contiguous along the input, and putting the columns back in order would need the activations
permuted too. (desc_act with static_groups keeps g_idx in input order and loads.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quiver_server.quant import fp8_checkpoint
from quiver_server.quant.fp8_checkpoint import Fp8Format
from quiver_server.quant.weights import QuantizedWeight

SUPPORTED = ("AWQ (4-bit, version gemm, with zero points), GPTQ (4- or 8-bit, checkpoint_format gptq or gptq_v2) "
             f"and {fp8_checkpoint.SUPPORTED}")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field j of an AWQ word holds column AWQ_ORDER[j] of its 8
_AWQ_FIELDS = tuple(AWQ_ORDER.index(column) for column in range(8))  # column c sits in field _AWQ_FIELDS[c]
_PIECES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class PrequantizedFormat:
    method: str  # "awq" (AutoAWQ GEMM) or "gptq"
    bits: int  # 4; GPTQ also 8
    group_size: int  # inputs per group; -1: one group per row
    zeros_minus_one: bool = False  # GPTQ v1: each stored zero point is the zero point minus one
    act_order: bool = False  # GPTQ desc_act: every module must carry its g_idx

    def required_pieces(self) -> frozenset[str]:
        pieces = {"qweight", "qzeros", "scales"}
        return frozenset(pieces | {"g_idx"} if self.act_order else pieces)


def checkpoint_quantization(config: Mapping[str, Any]) -> PrequantizedFormat | Fp8Format | None:
    """The pre-quantized format config.json declares, None where it has no quantization_config;
    a ValueError saying what is served for any other method or variant. FP8 checkpoints are
    dequantized at load (`fp8_checkpoint`)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"config.json's quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", qc.get("method", ""))).lower()
    if method == "awq":
        return _awq_format(qc)
    if method == "gptq":
        return _gptq_format(qc)
    if method in ("compressed-tensors", "fp8"):
        return fp8_checkpoint.fp8_format(qc, method)
    raise ValueError(f"pre-quantized checkpoints with quant_method {method!r} are not supported; "
                     f"quiver serves {SUPPORTED}")


def _group_size(qc: Mapping[str, Any]) -> int:
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group != -1 and group < 1):
        raise ValueError(f"quantization_config group_size must be a positive integer or -1, got {group!r}")
    return group


def _awq_format(qc: Mapping[str, Any]) -> PrequantizedFormat:
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"AWQ with bits={bits!r} is not supported (only 4-bit); quiver serves {SUPPORTED}")
    # AutoAWQ writes "version"; transformers writes both it and "format" (and names llm-awq as a backend).
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if str(qc.get("backend", "")).lower() == "llm-awq":
        version = "llm-awq"
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: it packs its words differently from GEMM; "
                         f"quiver serves {SUPPORTED} (not gemv, gemv_fast, exllama, marlin, llm-awq or ipex)")
    if qc.get("zero_point", True) is False:
        raise ValueError("AWQ without zero points (zero_point: false) is not supported: the GEMM format stores them; "
                         f"quiver serves {SUPPORTED}")
    return PrequantizedFormat("awq", 4, _group_size(qc))


def _gptq_format(qc: Mapping[str, Any]) -> PrequantizedFormat:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in (4, 8):
        raise ValueError(f"GPTQ with bits={bits!r} is not supported (only 4 and 8, not 2 or 3); "
                         f"quiver serves {SUPPORTED}")
    # transformers writes "checkpoint_format" and "format" alike; GPTQModel "format".
    layout = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        layout = "marlin"
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {layout!r} is not supported: its words are repacked for one "
                         f"kernel; quiver serves {SUPPORTED}")
    pack_dtype = str(qc.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise ValueError(f"GPTQ packed in {pack_dtype} words is not supported (int32 words are)")
    group = _group_size(qc)
    _check_dynamic(qc.get("dynamic"), bits, group)
    return PrequantizedFormat("gptq", bits, group, zeros_minus_one=layout == "gptq",
                              act_order=bool(qc.get("desc_act", False)))


def _check_dynamic(dynamic: Any, bits: int, group: int) -> None:
    """GPTQModel's `dynamic`: regex -> overrides, "-:" rules leaving modules unquantized (float,
    which loads as it is). Overrides giving modules other bits or groups are refused."""
    if not dynamic:
        return
    if not isinstance(dynamic, Mapping):
        raise ValueError(f"GPTQ dynamic must map module patterns to overrides, got {dynamic!r}")
    for rule, overrides in dynamic.items():
        if str(rule).startswith("-:") or not isinstance(overrides, Mapping):
            continue
        if overrides.get("bits", bits) != bits or overrides.get("group_size", group) != group:
            raise ValueError(f"GPTQ dynamic rule {rule!r} gives modules their own bits or group size "
                             f"({dict(overrides)}); per-module GPTQ formats are not supported")


def group_quantized_tensors(
    tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], fmt: PrequantizedFormat,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized module's qweight, qzeros, scales (and g_idx)
    joined into `<module>.weight` -> QuantizedWeight, yielded once the module's set is complete;
    every other tensor passes through as it comes. The pieces may come in any order, interleaved
    and across files. GPTQ's g_idx is optional unless desc_act: a module without one is yielded at
    the end. The weights are built on the pieces' device."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    complete = fmt.required_pieces() | ({"g_idx"} if fmt.method == "gptq" else set())
    for name, tensor in tensors:
        module, _, piece = name.rpartition(".")
        if not module or piece not in _PIECES:
            yield name, tensor
            continue
        if isinstance(tensor, QuantizedWeight):
            raise ValueError(f"{name} is already a quantized weight; expected a packed tensor")
        if piece == "g_idx" and fmt.method == "awq":
            raise ValueError(f"unexpected {name}: AWQ checkpoints have no g_idx")
        pieces = pending.setdefault(module, {})
        if piece in pieces or module in done:
            raise ValueError(f"{name} appears twice in the checkpoint")
        pieces[piece] = tensor
        if complete <= pieces.keys():
            done.add(module)
            yield f"{module}.weight", quantized_module(module, pending.pop(module), fmt)
    incomplete = {module: sorted(fmt.required_pieces() - pieces.keys()) for module, pieces in pending.items()}
    incomplete = {module: missing for module, missing in incomplete.items() if missing}
    if incomplete:
        listed = "; ".join(f"{module} lacks {', '.join(missing)}" for module, missing in sorted(incomplete.items()))
        raise ValueError(f"incomplete quantized modules in the {fmt.method.upper()} checkpoint: {listed}")
    for module, pieces in pending.items():
        yield f"{module}.weight", quantized_module(module, pieces, fmt)


def quantized_module(module: str, pieces: Mapping[str, torch.Tensor], fmt: PrequantizedFormat) -> QuantizedWeight:
    """One module's packed tensors (qweight, qzeros, scales, optionally g_idx) as a QuantizedWeight."""
    for piece in ("qweight", "qzeros", "scales"):
        tensor = pieces[piece]
        if tensor.dim() != 2:
            raise ValueError(f"{module}.{piece} must be 2-D, got shape {tuple(tensor.shape)}")
        if piece != "scales" and tensor.dtype != torch.int32:
            raise ValueError(f"{module}.{piece} must be int32 words, got {tensor.dtype}")
    if not pieces["scales"].is_floating_point():
        raise ValueError(f"{module}.scales must be floating point, got {pieces['scales'].dtype}")
    if fmt.method == "awq":
        return _awq_weight(module, pieces["qweight"], pieces["qzeros"], pieces["scales"], fmt.group_size)
    return _gptq_weight(module, pieces, fmt)


def _unpack(words: torch.Tensor, bits: int, fields: Sequence[int]) -> torch.Tensor:
    """[..., n] words -> [..., n * len(fields)]: value i of each word is its field fields[i].
    An arithmetic shift leaves the masked field intact, so signed words need no widening."""
    shifts = torch.tensor([bits * f for f in fields], dtype=words.dtype, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _groups(module: str, in_features: int, scales: torch.Tensor, group_size: int) -> int:
    """The group size the scales' rows make of `in_features` inputs, checked against the config's."""
    groups = int(scales.shape[0])
    expected = 1 if group_size == -1 else -(-in_features // group_size)
    if groups != expected:
        raise ValueError(f"{module}.scales has {groups} groups for {in_features} inputs; "
                         f"group_size {group_size} makes {expected}")
    group = in_features if groups == 1 else group_size
    if in_features % group:
        raise ValueError(f"{module}: {in_features} inputs end in a partial group of "
                         f"{in_features % group} (groups of {group}); partial groups are not supported")
    return group


def _check_shape(module: str, piece: str, tensor: torch.Tensor, shape: tuple[int, int]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{module}.{piece} has shape {tuple(tensor.shape)}, expected {shape}")


def _awq_weight(
    module: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
) -> QuantizedWeight:
    in_features, out_features = int(qweight.shape[0]), int(qweight.shape[1]) * 8
    groups = int(scales.shape[0])
    _check_shape(module, "scales", scales, (groups, out_features))
    _check_shape(module, "qzeros", qzeros, (groups, out_features // 8))
    group = _groups(module, in_features, scales, group_size)
    q = _unpack(qweight, 4, _AWQ_FIELDS).t().to(torch.uint8).contiguous()  # [out, in]
    zeros = _unpack(qzeros, 4, _AWQ_FIELDS).t().to(torch.float32)  # [out, groups]
    scale = scales.t().to(torch.float32).contiguous()
    return QuantizedWeight(4, q, scale, (-scale * zeros).contiguous(), group)


def _gptq_weight(module: str, pieces: Mapping[str, torch.Tensor], fmt: PrequantizedFormat) -> QuantizedWeight:
    qweight, qzeros, scales = pieces["qweight"], pieces["qzeros"], pieces["scales"]
    per_word = 32 // fmt.bits
    in_features, out_features = int(qweight.shape[0]) * per_word, int(qweight.shape[1])
    groups = int(scales.shape[0])
    _check_shape(module, "scales", scales, (groups, out_features))
    _check_shape(module, "qzeros", qzeros, (groups, -(-out_features // per_word)))  # the last word may be partial
    group = _groups(module, in_features, scales, fmt.group_size)
    g_idx = pieces.get("g_idx")
    if g_idx is not None:
        _check_g_idx(module, g_idx, in_features, group)
    plain = range(per_word)
    q = _unpack(qweight.t(), fmt.bits, plain)  # [out, in]
    if fmt.zeros_minus_one:
        # v1 stores zero - 1 in each field. Adding one to every field of the whole word, carries
        # included, is the exact inverse of GPTQModel's v2 -> v1 (it subtracts from the word),
        # and per field +1 wherever no field holds -1 (AutoGPTQ's writer never stores one).
        ones = sum(1 << (fmt.bits * j) for j in plain)
        qzeros = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF
    zeros = _unpack(qzeros, fmt.bits, plain)[:, :out_features].t().to(torch.float32)  # [out, groups]
    scale = scales.t().to(torch.float32).contiguous()
    if fmt.bits == 4:
        return QuantizedWeight(4, q.to(torch.uint8), scale, (-scale * zeros).contiguous(), group)
    # QuantizedWeight's 8-bit q is int8: (q - zero) * s = (q - 128) * s + (128 - zero) * s, and a
    # symmetric checkpoint's zeros are all 128, so it needs no offsets.
    centred = (q - 128).to(torch.int8)
    offsets = None if bool((zeros == 128).all()) else (scale * (128 - zeros)).contiguous()
    return QuantizedWeight(8, centred, scale, offsets, group)


def _check_g_idx(module: str, g_idx: torch.Tensor, in_features: int, group: int) -> None:
    if tuple(g_idx.shape) != (in_features,):
        raise ValueError(f"{module}.g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    in_order = torch.arange(in_features, device=g_idx.device) // group
    if not torch.equal(g_idx.to(torch.int64), in_order):
        raise ValueError(f"{module}: act-order (desc_act) GPTQ checkpoints whose g_idx reorders the groups of the "
                         "inputs are not supported: quiver keeps each group contiguous along the input; "
                         "quantize with desc_act=False (or static_groups=True)")
