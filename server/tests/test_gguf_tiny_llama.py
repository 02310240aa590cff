"""A whole llama-architecture GGUF file read by `quant/gguf_model.py` against transformers' own GGUF
loader: a tiny random Llama written with the `gguf` package's GGUFWriter as llama.cpp's converter
writes one (q/k rows permuted for its rotary layout, projections in Q8_0, Q4_0 and Q4_1, the
embedding in Q8_0, norms in F32/F16, the LM head in BF16 or absent when tied). Every tensor, its
projections dequantized, must equal transformers' state_dict entry of the same name exactly, and
the config must be transformers'. The float model it came from is a second, independent reference:
a q/k row order put back wrongly would be far from it, a right one within the quantization's error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter, quants
from gguf_files import add, add_shape, assert_tensors_equal, finish, llama_cpp_rows
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from quiver_server.quant.gguf_model import gguf_config, iter_gguf_tensors
from quiver_server.quant.weights import QuantizedWeight

CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
# One quantized type per projection, so that each of them meets each read path.
PROJECTIONS = {"self_attn.q_proj": ("attn_q", GGMLType.Q8_0), "self_attn.k_proj": ("attn_k", GGMLType.Q4_0),
               "self_attn.v_proj": ("attn_v", GGMLType.Q4_1), "self_attn.o_proj": ("attn_output", GGMLType.Q8_0),
               "mlp.gate_proj": ("ffn_gate", GGMLType.Q4_1), "mlp.up_proj": ("ffn_up", GGMLType.Q4_0),
               "mlp.down_proj": ("ffn_down", GGMLType.Q8_0)}
NORMS = {"input_layernorm": ("attn_norm", GGMLType.F32), "post_attention_layernorm": ("ffn_norm", GGMLType.F16)}


def write_gguf(path: Path, model: LlamaForCausalLM, tied: bool) -> None:
    weights = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    add_shape(writer, CONFIG, CONFIG["max_position_embeddings"])
    writer.add_rope_dimension_count(CONFIG["head_dim"])
    add(writer, "token_embd.weight", weights["model.embed_tokens.weight"], GGMLType.Q8_0)
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for hf, (gguf_name, kind) in PROJECTIONS.items():
            value = weights[f"{prefix}.{hf}.weight"]
            if gguf_name == "attn_q":
                value = llama_cpp_rows(value, CONFIG["num_attention_heads"])
            elif gguf_name == "attn_k":
                value = llama_cpp_rows(value, CONFIG["num_key_value_heads"])
            add(writer, f"blk.{layer}.{gguf_name}.weight", value, kind)
        for hf, (gguf_name, kind) in NORMS.items():
            add(writer, f"blk.{layer}.{gguf_name}.weight", weights[f"{prefix}.{hf}.weight"], kind)
    add(writer, "output_norm.weight", weights["model.norm.weight"], GGMLType.F32)
    if not tied:
        add(writer, "output.weight", weights["lm_head.weight"], GGMLType.BF16)
    finish(writer)


def random_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms too: ones would hide a norm/tensor mix-up
            param.normal_(0.0, 0.05 if param.dim() > 1 else 1.0)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_equals_transformers_gguf_loader(tmp_path: Path, tied: bool) -> None:
    original = random_llama(tied)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, original, tied)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = {name: t.detach() for name, t in loaded.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")  # the embedding's own tensor, which the file stores once
    quantized = assert_tensors_equal(path, expected, original.state_dict())

    projections = {f"model.layers.{n}.{hf}.weight": 8 if kind == GGMLType.Q8_0 else 4
                   for n in range(CONFIG["num_hidden_layers"]) for hf, (_, kind) in PROJECTIONS.items()}
    assert quantized == projections  # projections stay quantized; embedding, norms and head are float


@pytest.mark.parametrize("tied", [False, True])
def test_config_is_transformers_and_the_models(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, random_llama(tied), tied)
    config = gguf_config(path)
    assert config == AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).to_dict()
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is tied
    # The model's own config, but for GGUF's float32 epsilon.
    want = LlamaConfig(**{**CONFIG, "rms_norm_eps": float(np.float32(CONFIG["rms_norm_eps"]))}).to_dict()
    for key in (*CONFIG, "rope_parameters", "hidden_act", "attention_bias", "mlp_bias"):
        if key != "rope_theta":  # transformers keeps it in rope_parameters
            assert config[key] == want[key], key


def test_rotary_order_is_put_back_for_quantized_rows_exactly(tmp_path: Path) -> None:
    """q_proj as the file stores it, read back: its QuantizedWeight's rows are the checkpoint's
    rows, each row's values, scales and offsets moved together (Q4_1 has all three)."""
    heads, head_dim, width = 4, 64, 256
    weight = np.random.default_rng(5).standard_normal((heads * head_dim, width)).astype(np.float32)
    raw = quants.quantize(llama_cpp_rows(weight, heads), GGMLType.Q4_1)
    want = torch.from_numpy(quants.dequantize(quants.quantize(weight, GGMLType.Q4_1), GGMLType.Q4_1))
    path = tmp_path / "q.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLType.Q4_1)
    finish(writer)
    [(name, value)] = list(iter_gguf_tensors(path))
    assert name == "model.layers.0.self_attn.q_proj.weight"
    assert isinstance(value, QuantizedWeight) and value.offsets is not None
    torch.testing.assert_close(value.dequantize(), want, atol=0, rtol=0)
