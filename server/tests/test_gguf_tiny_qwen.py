"""Qwen2 and Qwen3 GGUF files read by `quant/gguf_model.py` against transformers' own GGUF loader:
tiny random models written with the `gguf` package's GGUFWriter as llama.cpp's converter writes
these architectures (q/k rows as they are: Qwen's rotary is llama.cpp's NEOX layout; Qwen2's
q/k/v biases, Qwen3's per-head q/k norms), projections in Q8_0, Q4_0 and Q4_1. Every tensor must
equal transformers' state_dict entry exactly and stay within the quantization's error of the
float model it came from (a permuted row order would not); the config must be transformers';
and the model served from the file must give the logits transformers gives on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from device import TEST_DEVICE
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter
from quant_cases import prefill_every_position
from gguf_files import add, add_shape, assert_tensors_equal, finish
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from quiver_server.gguf_source import SOURCE_FILE
from quiver_server.models import load_model
from quiver_server.quant.gguf_model import gguf_config

CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0}
HEAD_DIM = 128  # Qwen3's default, which transformers' GGUF config relies on
PROJECTIONS = {"self_attn.q_proj": ("attn_q", GGMLType.Q8_0), "self_attn.k_proj": ("attn_k", GGMLType.Q4_0),
               "self_attn.v_proj": ("attn_v", GGMLType.Q4_1), "self_attn.o_proj": ("attn_output", GGMLType.Q8_0),
               "mlp.gate_proj": ("ffn_gate", GGMLType.Q4_1), "mlp.up_proj": ("ffn_up", GGMLType.Q4_0),
               "mlp.down_proj": ("ffn_down", GGMLType.Q8_0)}
FLOATS = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
# architecture -> (model class, its config, tied embeddings)
ARCHS = {"qwen2": (Qwen2ForCausalLM, Qwen2Config(**CONFIG, tie_word_embeddings=True), True),
         "qwen3": (Qwen3ForCausalLM, Qwen3Config(**CONFIG, head_dim=HEAD_DIM, tie_word_embeddings=False), False)}


def random_model(arch: str) -> torch.nn.Module:
    cls, config, _ = ARCHS[arch]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases too: ones or zeros would hide a mix-up
            param.normal_(0.0, 0.05 if param.dim() > 1 else 1.0)
    return model


def write_gguf(path: Path, arch: str, model: torch.nn.Module) -> None:
    weights = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    add_shape(writer, CONFIG, CONFIG["max_position_embeddings"])
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    add(writer, "token_embd.weight", weights["model.embed_tokens.weight"], GGMLType.Q8_0)
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for hf, (gguf_name, kind) in PROJECTIONS.items():
            add(writer, f"blk.{layer}.{gguf_name}.weight", weights[f"{prefix}.{hf}.weight"], kind)
        for hf, gguf_name in FLOATS.items():
            if f"{prefix}.{hf}" in weights:
                add(writer, f"blk.{layer}.{gguf_name}", weights[f"{prefix}.{hf}"], GGMLType.F32)
    add(writer, "output_norm.weight", weights["model.norm.weight"], GGMLType.F32)
    if not ARCHS[arch][2]:
        add(writer, "output.weight", weights["lm_head.weight"], GGMLType.F16)
    finish(writer)


@pytest.fixture(scope="module", params=list(ARCHS))
def qwen_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    original = random_model(arch)
    path = root / f"tiny-{arch}.gguf"
    write_gguf(path, arch, original)
    loaded = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32).eval()
    return arch, path, original, loaded


def test_every_tensor_equals_transformers_gguf_loader(qwen_gguf) -> None:
    arch, path, original, loaded = qwen_gguf
    expected = {name: t.detach() for name, t in loaded.state_dict().items()}
    if ARCHS[arch][2]:
        expected.pop("lm_head.weight")  # the embedding's own tensor, stored once
    quantized = assert_tensors_equal(path, expected, original.state_dict())  # permuted q/k rows are not
    assert len(quantized) == CONFIG["num_hidden_layers"] * len(PROJECTIONS)


def test_config_is_transformers(qwen_gguf) -> None:
    arch, path, _, _ = qwen_gguf
    config = gguf_config(path)
    assert config == AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    assert config["model_type"] == arch and config["tie_word_embeddings"] is ARCHS[arch][2]
    assert config["num_key_value_heads"] == CONFIG["num_key_value_heads"]
    assert config.get("head_dim", HEAD_DIM) == HEAD_DIM


@torch.inference_mode()
def test_the_file_served_gives_transformers_logits(qwen_gguf, tmp_path: Path) -> None:
    """The shard's loader on a companion directory pointing at the file (as `--model-id x.gguf`
    prepares it), projections quantized as stored, against transformers on the same file."""
    _, path, _, loaded = qwen_gguf
    companion = tmp_path / "companion"
    companion.mkdir()
    config = gguf_config(path)
    (companion / "config.json").write_text(json.dumps(config))
    (companion / SOURCE_FILE).write_text(json.dumps({"gguf": str(path)}))
    model = load_model(companion, config, torch.float32, TEST_DEVICE)
    prompts = [[5, 17, 33, 2, 250, 9, 71], [100, 3, 44]]
    run = prefill_every_position(model, prompts, 0, TEST_DEVICE)
    for prompt, logits in zip(prompts, run.logits, strict=True):
        torch.testing.assert_close(logits, loaded(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)
