"""llama.cpp's quantized blocks as `QuantizedWeight`s, without dequantizing them.

A GGUF tensor of `out` rows stores each row as consecutive blocks along the input dimension
(ggml's layout, from llama.cpp's ggml-common.h / the `gguf` package's quants.py):

- Q8_0 (34 bytes / 32 values): fp16 d, 32 int8 q; w = d q.
- Q4_0 (18 / 32): fp16 d, 16 bytes; value i < 16 in byte i's low nibble, value 16 + i in its
  high one; w = d (q - 8).
- Q4_1 (20 / 32): fp16 d, fp16 m, 16 bytes as Q4_0; w = d q + m.
- Q4_K (144 / 256): fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes:
  four chunks of 32 bytes, whose low nibbles are sub-block 2j's 32 values and high nibbles
  sub-block 2j + 1's; w = d sc_j q - dmin m_j.
- Q6_K (210 / 256): 128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales, fp16 d;
  w = d sc (q - 32), one scale per 16 values.

Each maps onto groups of 32 (16 for Q6_K) with float32 scales and offsets, products of an fp16
and a small integer: exact, so a kernel's w equals ggml's dequantized value.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType

from quiver_server.quant.weights import QuantizedWeight

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
QUANTIZED_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K)


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from [..., 2] bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d = _half(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    return q, d, None, 32


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d = _half(blocks[..., 0:2])
    return _nibbles_32(blocks[..., 2:18]), d, -8 * d, 32


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d, m = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    return _nibbles_32(blocks[..., 4:20]), d, m, 32


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    low, high = packed[..., 0:4], packed[..., 4:8]
    tail = packed[..., 8:12]
    scales = np.concatenate([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    chunks = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    q = np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*blocks.shape[:-1], 256)
    return q, d[..., None] * sc, -(dmin[..., None] * mn), 32


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks[..., 208:210])
    # Per half of 128 values: four runs of 32, low 4 bits from ql, high 2 bits from qh.
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(*blocks.shape[:-1], 256)
    return q, d[..., None] * sc, None, 16


_DECODERS = {GGMLType.Q8_0: (34, 32, _q8_0), GGMLType.Q4_0: (18, 32, _q4_0), GGMLType.Q4_1: (20, 32, _q4_1),
             GGMLType.Q4_K: (144, 256, _q4_k), GGMLType.Q6_K: (210, 256, _q6_k)}


def quantized_weight(name: str, kind: GGMLType, data: np.ndarray, out: int, inp: int) -> QuantizedWeight:
    """A quantized 2-D tensor's raw rows ([out, row bytes]) as a `QuantizedWeight` [out, inp]."""
    if kind not in _DECODERS:
        raise ValueError(f"{name}: GGUF type {kind.name} is not supported (quantized types served: "
                         f"{', '.join(t.name for t in QUANTIZED_TYPES)}; float: F32, F16, BF16)")
    block_bytes, block_values, decode = _DECODERS[kind]
    if inp % block_values:
        raise ValueError(f"{name}: {inp} inputs are not whole {kind.name} blocks of {block_values}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(out, inp // block_values, block_bytes)
    q, scales, offsets, group = decode(blocks)
    bits = 8 if kind in (GGMLType.Q8_0, GGMLType.Q6_K) else 4
    q_tensor = torch.from_numpy(np.ascontiguousarray(q).reshape(out, inp))
    q_tensor = q_tensor.to(torch.int8 if bits == 8 else torch.uint8)
    groups = (out, inp // group)
    offset_tensor = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets).reshape(groups))
    return QuantizedWeight(bits, q_tensor, torch.from_numpy(np.ascontiguousarray(scales).reshape(groups)),
                           offset_tensor, group)


def float_tensor(name: str, kind: GGMLType, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32/F16/BF16 tensor as float32 of `shape` (outermost first)."""
    if kind == GGMLType.F32:
        values = np.asarray(data, dtype=np.float32)
    elif kind == GGMLType.F16:
        values = np.asarray(data).view(np.float16).astype(np.float32)
    elif kind == GGMLType.BF16:
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        values = bits.view(np.float32)
    else:
        raise ValueError(f"{name}: GGUF type {kind.name} is not a float type")
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy
