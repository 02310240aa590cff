"""llama.cpp's quantized blocks read as `QuantizedWeight`s (`quant/gguf_blocks.py`) against the
`gguf` package's own dequantization of the same bytes, which must agree exactly: Q8_0, Q4_0 and
Q4_1 quantized by `gguf` from random floats, Q4_K and Q6_K random blocks (every bit pattern of
their packed scales and high bits) with finite fp16 scales; several row counts and widths.
And what the model loader does with them: parts of mixed types (a Q4_K_M file's Q4_K q_proj
beside a Q6_K v_proj) joined exactly, the CPU kernel multiplying by them as by their floats,
the float types read as they are, and unsupported types named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as GGMLType

from quiver_server.kernels import quant_gemm
from quiver_server.quant.gguf_blocks import float_tensor, quantized_weight
from quiver_server.quant.weights import concat_rows

FP16_FIELDS = {GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,)}  # byte offsets of fp16 d / dmin


def raw_rows(kind: GGMLType, rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        return quants.quantize(rng.standard_normal((rows, width)).astype(np.float32), kind)
    values, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, width // values, size), dtype=np.uint8)
    for offset in FP16_FIELDS[kind]:
        scale = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q6_K])
@pytest.mark.parametrize("rows,width", [(1, 256), (7, 512), (33, 768)])
def test_blocks_equal_the_gguf_packages_dequantization(kind, rows, width) -> None:
    raw = raw_rows(kind, rows, width, seed=rows + width)
    weight = quantized_weight("t", kind, raw, rows, width)
    assert (weight.out_features, weight.in_features) == (rows, width)
    np.testing.assert_array_equal(weight.dequantize().numpy(), quants.dequantize(raw, kind))


def test_q4_k_and_q6_k_parts_join_into_one_weight_exactly() -> None:
    q4k = quantized_weight("q", GGMLType.Q4_K, raw_rows(GGMLType.Q4_K, 8, 256, 1), 8, 256)
    q6k = quantized_weight("v", GGMLType.Q6_K, raw_rows(GGMLType.Q6_K, 4, 256, 2), 4, 256)
    joined = concat_rows([q4k, q6k])
    assert (joined.bits, joined.group_size) == (8, 16)
    torch.testing.assert_close(joined.dequantize(), torch.cat([q4k.dequantize(), q6k.dequantize()]), atol=0, rtol=0)
    x = torch.randn(3, 256, dtype=torch.float64)
    got = quant_gemm.linear(x.float(), quant_gemm.pack(joined, torch.device("cpu")), None)
    want = x @ joined.dequantize().double().T
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()


def test_float_types_read_as_they_are() -> None:
    values = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(float_tensor("f", GGMLType.F32, values, (4, 6)).numpy(), values)
    half = values.astype(np.float16)
    np.testing.assert_array_equal(float_tensor("h", GGMLType.F16, half.view(np.uint8), (4, 6)).numpy(),
                                  half.astype(np.float32))
    bf16 = torch.from_numpy(values).to(torch.bfloat16)
    raw = bf16.view(torch.int16).numpy().view(np.uint8)
    torch.testing.assert_close(float_tensor("b", GGMLType.BF16, raw, (4, 6)), bf16.float(), atol=0, rtol=0)


def test_unsupported_types_are_named() -> None:
    with pytest.raises(ValueError, match="blk.0.attn_q.weight: GGUF type Q5_K is not supported"):
        quantized_weight("blk.0.attn_q.weight", GGMLType.Q5_K, np.zeros((1, 176), np.uint8), 1, 256)
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        quantized_weight("w", GGMLType.Q4_K, np.zeros((1, 144), np.uint8), 1, 128)
