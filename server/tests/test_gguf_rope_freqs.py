"""Llama 3.1+'s rope scaling in a GGUF file: llama.cpp's converter drops the `rope_scaling` config
and stores one divisor per rotary frequency as the tensor `rope_freqs` (its formula written out
here, from the converter's published code, in float32 as it computes). `gguf_config` must recover
transformers' `llama3` rope parameters from that tensor, and the model served from the file must
give the logits of the original transformers model with its rope scaling, which differ visibly
from the same weights without it; divisors no Llama 3 scaling makes are refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from device import TEST_DEVICE
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter
from quant_cases import prefill_every_position
from gguf_files import add, add_shape, finish, llama_cpp_rows
from test_gguf_tiny_llama import CONFIG
from transformers import LlamaConfig, LlamaForCausalLM

from quiver_server.gguf_source import SOURCE_FILE
from quiver_server.models import load_model
from quiver_server.quant.gguf_model import gguf_config, iter_gguf_tensors, llama3_rope_from_factors

HEAD_DIM = CONFIG["head_dim"]
# (factor, low_freq_factor, high_freq_factor, original positions): Llama 3.1's, Llama 3.2's, a
# band of its own recovered from its two blended divisors, and a narrow one (one blended divisor).
SCALINGS = {"llama-3.1": (8.0, 1.0, 4.0, 8192), "llama-3.2": (32.0, 1.0, 4.0, 8192),
            "fitted-band": (8.0, 1.0, 3.0, 6000), "narrow-band": (16.0, 1.0, 2.0, 4096)}


def converter_rope_freqs(factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf for a llama3 rope_scaling, step by step."""
    base = CONFIG["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    low_wavelen, high_wavelen = original / low, original / high
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def scaled_llama(scaling: tuple[float, float, float, int]) -> LlamaForCausalLM:
    factor, low, high, original = scaling
    config = LlamaConfig(**{**CONFIG, "max_position_embeddings": 16 * original},
                         rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                       "high_freq_factor": high, "original_max_position_embeddings": original})
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.05 if param.dim() > 1 else 1.0)
    return model


def write_float_gguf(path: Path, model: LlamaForCausalLM, rope_freqs: np.ndarray | None) -> None:
    """Every tensor in F32 (the served model is then the original's weights exactly)."""
    weights = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer = GGUFWriter(str(path), "llama")
    add_shape(writer, CONFIG, model.config.max_position_embeddings)
    writer.add_rope_dimension_count(HEAD_DIM)
    if rope_freqs is not None:
        add(writer, "rope_freqs.weight", rope_freqs, GGMLType.F32)
    for name, value in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = CONFIG["num_attention_heads"] if "q_proj" in name else CONFIG["num_key_value_heads"]
            value = llama_cpp_rows(value, heads)
        gguf_name = (name.replace("model.embed_tokens", "token_embd").replace("model.norm", "output_norm")
                     .replace("lm_head", "output").replace("model.layers.", "blk.")
                     .replace("self_attn.q_proj", "attn_q").replace("self_attn.k_proj", "attn_k")
                     .replace("self_attn.v_proj", "attn_v").replace("self_attn.o_proj", "attn_output")
                     .replace("mlp.gate_proj", "ffn_gate").replace("mlp.up_proj", "ffn_up")
                     .replace("mlp.down_proj", "ffn_down").replace("post_attention_layernorm", "ffn_norm")
                     .replace("input_layernorm", "attn_norm"))
        add(writer, gguf_name, value, GGMLType.F32)
    finish(writer)


def served(path: Path, companion: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    companion.mkdir()
    config = gguf_config(path)
    (companion / "config.json").write_text(json.dumps(config))
    (companion / SOURCE_FILE).write_text(json.dumps({"gguf": str(path)}))
    model = load_model(companion, config, torch.float32, TEST_DEVICE)
    return prefill_every_position(model, prompts, 0, TEST_DEVICE).logits


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_scaling_is_read_back_from_rope_freqs(name: str, tmp_path: Path) -> None:
    factor, low, high, original = SCALINGS[name]
    original_model = scaled_llama(SCALINGS[name])
    path = tmp_path / "scaled.gguf"
    write_float_gguf(path, original_model, converter_rope_freqs(*SCALINGS[name]))
    rope = gguf_config(path)["rope_parameters"]
    assert rope == {"rope_theta": CONFIG["rope_theta"], "rope_type": "llama3", "factor": factor,
                    "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": original}
    assert "rope_freqs.weight" not in dict(iter_gguf_tensors(path))


@torch.inference_mode()
def test_the_file_served_gives_the_scaled_models_logits(tmp_path: Path) -> None:
    model = scaled_llama(SCALINGS["llama-3.1"])
    path = tmp_path / "scaled.gguf"
    write_float_gguf(path, model, converter_rope_freqs(*SCALINGS["llama-3.1"]))
    prompts = [[(7 * i + 3) % CONFIG["vocab_size"] for i in range(120)], [5, 17, 33, 2]]
    ours = served(path, tmp_path / "companion", prompts)
    plain = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    plain.load_state_dict(model.state_dict())
    for prompt, logits in zip(prompts, ours, strict=True):
        want = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    # The scaling matters at these positions: the same weights without it are far off.
    unscaled = plain(torch.tensor([prompts[0]])).logits[0]
    assert (unscaled - model(torch.tensor([prompts[0]])).logits[0]).abs().max() > 1e-2


def test_divisors_no_llama3_scaling_makes_are_refused() -> None:
    divisors = converter_rope_freqs(*SCALINGS["llama-3.1"]).astype(np.float64)
    divisors[3] = 1.5  # a high-frequency dimension scaled: no llama3 band does that
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_from_factors(divisors, CONFIG["rope_theta"], HEAD_DIM)
