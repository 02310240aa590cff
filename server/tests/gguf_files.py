"""Writing GGUF files for the GGUF tests as llama.cpp's converter writes them (with the `gguf`
package's GGUFWriter), and checking what `quant.gguf_model` reads back against transformers' own
GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter, quants

from quiver_server.quant.gguf_model import iter_gguf_tensors
from quiver_server.quant.weights import QuantizedWeight


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k order for the llama architecture, written out here: within
    each head, row 2 i + j of the file is row j * D/2 + i of the checkpoint (the rotary halves
    interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def add(writer: GGUFWriter, name: str, value: np.ndarray, kind: GGMLType) -> None:
    if kind == GGMLType.F32:
        writer.add_tensor(name, value.astype(np.float32))
    elif kind == GGMLType.F16:
        writer.add_tensor(name, value.astype(np.float16))
    elif kind == GGMLType.BF16:
        raw = torch.from_numpy(value).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    else:
        raw = quants.quantize(value.astype(np.float32), kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)


def add_shape(writer: GGUFWriter, config: dict[str, Any], context_length: int) -> None:
    """The model's shape keys, as the converter writes them (the vocabulary size too, so that
    transformers' config needs no tokenizer)."""
    writer.add_context_length(context_length)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_tensors_equal(path: Path, expected: dict[str, torch.Tensor],
                         source: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor `iter_gguf_tensors` reads from `path` (quantized ones dequantized) equals
    transformers' entry of the same name exactly, and lies within Q4_0's error of the float
    weight it was written from (a wrong row order does not); every expected tensor is read.
    Returns the quantized ones' bits by name."""
    expected = dict(expected)
    quantized = {}
    for name, value in iter_gguf_tensors(path):
        if isinstance(value, QuantizedWeight):
            quantized[name] = value.bits
            value = value.dequantize()
        torch.testing.assert_close(value, expected.pop(name), atol=0, rtol=0, msg=name)
        assert (value - source[name]).abs().max() < 0.2 * source[name].abs().max(), name
    assert not expected, f"tensors transformers has that were not read: {sorted(expected)}"
    return quantized
