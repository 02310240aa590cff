"""A GGUF file of the llama, qwen2 or qwen3 architecture (Llama, Mistral, SmolLM2, Qwen2.5,
Qwen3... as llama.cpp writes them) as a transformers checkpoint: its config, and its tensors
under transformers' names, quantized projections left quantized (`gguf_blocks`). Qwen2's q/k/v
biases and Qwen3's per-head q/k norms map like the rest.

For the llama architecture, llama.cpp's converter reorders the rows of q_proj and k_proj for its
rotary layout (each head's two halves interleaved); the rows are put back here as transformers'
GGUF loader does. Qwen's rotary already is llama.cpp's NEOX layout: its rows are stored as they
are.
A quantized weight's groups run along the input dimension, so reordering its rows reorders its
values, scales and offsets alike and stays exact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from quiver_server.quant.gguf_blocks import FLOAT_TYPES, float_tensor, quantized_weight
from quiver_server.quant.weights import QuantizedWeight

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_ROTARY_ROWS_PERMUTED = ("llama",)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+'s rope scaling: read into the config, not a weight
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Kept float even when the file quantized them: the lookup table and norms (`load_weights`
# dequantizes whatever is not a projection).
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    if value.dtype == np.uint8 and key.endswith("architecture"):
        return bytes(value).decode()
    return value.tolist()[0] if len(value) == 1 else value.tolist()


def architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served yet (served: {', '.join(ARCHITECTURES)})")
    return str(arch)


def gguf_config(path: Path) -> dict[str, Any]:
    """config.json's contents for the model in GGUF file `path`, as transformers derives them."""
    from transformers import AutoConfig

    reader = GGUFReader(str(path))
    arch = architecture(reader)
    config = AutoConfig.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
    data: dict[str, Any] = config.to_dict()
    # transformers' GGUF config reads no head size: Qwen3's default (128) holds for its releases,
    # but the file's own key length is the truth where it says otherwise.
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None and "head_dim" in data and int(key_length) != data["head_dim"]:
        data["head_dim"] = int(key_length)
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        rope = dict(data.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", data.get("rope_theta", 10000.0)))
        dim = int(_field(reader, f"{arch}.rope.dimension_count") or data.get("head_dim")
                  or data["hidden_size"] // data["num_attention_heads"])
        rope.update(llama3_rope_from_factors(np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1), theta, dim))
        data["rope_parameters"] = rope
    return data


def _converter_factors(theta: float, dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes for Llama 3's rope scaling, from its parameters."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def llama3_rope_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """Llama 3.1+'s rope scaling from the `rope_freqs` tensor llama.cpp stores in its place (one
    divisor per frequency) as transformers' `llama3` rope parameters. The factor is the largest
    divisor; the band is Llama 3's own (low 1, high 4, 8,192 original positions), or the line
    through the blended divisors with low 1, or one of the usual bands. It must reproduce every
    divisor of the file (parameters that do give the same rotary), or the file is refused: a
    rope served differently from the one it was trained with would change every position."""
    factor = float(factors.max())
    candidates = [(1.0, 4.0, 8192)]
    if factor > 1.0:
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        inverse_wavelen = freqs / (2 * math.pi)
        blend = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
        if blend.sum() >= 2:
            # 1/divisor = (1 - s)/factor + s, with s = original * (1/wavelen) / (high - 1) - 1 / (high - 1)
            s = (1.0 / factors[blend] - 1.0 / factor) / (1.0 - 1.0 / factor)
            slope, intercept = np.polyfit(inverse_wavelen[blend], s, 1)
            if intercept < 0:
                high = 1.0 - 1.0 / intercept
                # The file's float32 divisors blur the line's last digits: a band is a simple number.
                candidates.append((1.0, round(float(high), 3), int(round(-slope / intercept))))
    # Fewer than two blended divisors pin no line: the bands such models are released with.
    candidates += [(1.0, high, original) for high in (2.0, 4.0, 8.0)
                   for original in (2048, 4096, 8192, 16384, 32768)]
    for low, high, original in candidates:
        if len(factors) == dim // 2 and np.allclose(_converter_factors(theta, dim, factor, low, high, original),
                                                    factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ValueError("GGUF tensor 'rope_freqs.weight' holds rope divisors that no Llama 3 rope scaling reproduces; "
                     "serve the model's safetensors checkpoint instead")


def _hf_name(name: str) -> tuple[str, str | None]:
    """(transformers name, llama.cpp projection kind or None)."""
    if name in _GLOBAL:
        return _GLOBAL[name], None
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER[kind]}.{suffix}", kind


def rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for `heads` heads: new row
    h * D + j * D/2 + i is old row h * D + 2 i + j."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _reorder(tensor: torch.Tensor | QuantizedWeight, order: torch.Tensor) -> torch.Tensor | QuantizedWeight:
    if isinstance(tensor, torch.Tensor):
        return tensor[order].contiguous()
    offsets = None if tensor.offsets is None else tensor.offsets[order].contiguous()
    return QuantizedWeight(tensor.bits, tensor.q[order].contiguous(), tensor.scales[order].contiguous(), offsets,
                           tensor.group_size)


def iter_gguf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of GGUF file `path` under transformers' name, in float32 or (projection
    weights stored quantized) as a `QuantizedWeight`."""
    reader = GGUFReader(str(path))
    arch = architecture(reader)
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # in the config (`gguf_config`)
        name, kind = _hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the innermost first
        value: torch.Tensor | QuantizedWeight
        if tensor.tensor_type in FLOAT_TYPES:
            value = float_tensor(tensor.name, tensor.tensor_type, tensor.data, shape)
        elif len(shape) == 2:
            value = quantized_weight(tensor.name, tensor.tensor_type, tensor.data, shape[0], shape[1])
            if kind not in _PROJECTIONS:
                value = value.dequantize()
        else:
            raise ValueError(f"{tensor.name}: a quantized tensor of {len(shape)} dimensions")
        if arch in _ROTARY_ROWS_PERMUTED and kind in ("attn_q", "attn_k"):
            value = _reorder(value, rotary_rows(shape[0], heads if kind == "attn_q" else kv_heads))
        yield name, value
