"""FP8 checkpoints (`quant.fp8_checkpoint`): a tiny Llama's projections written in float8 e4m3
with per-channel, per-tensor and block scales, as llm-compressor's compressed-tensors
`float-quantized` format and transformers' fine-grained `fp8` method lay them out, served through
quiver's loader against transformers on the weights dequantized here (q.float() * scale, each
scale spread over its row, tensor or tile by hand); the config schemes read and refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformers
from device import TEST_DEVICE
from quant_cases import prefill_every_position, write_checkpoint
from tiny_models import build_tiny_model

from quiver_server.layers.linear import Linear
from quiver_server.models import load_model
from quiver_server.quant.fp8_checkpoint import Fp8Format, dequantized_fp8_tensors
from quiver_server.quant.prequantized import checkpoint_quantization
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.weights import load_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0
BLOCK = (16, 32)  # small tiles, so the tiny model's projections hold several, some partial


def channel_weight(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.to(torch.bfloat16)}


def tensor_weight(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().amax().reshape(1) / E4M3_MAX
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}


def block_weight(w: torch.Tensor, scale_name: str) -> dict[str, torch.Tensor]:
    out, inp = w.shape
    rows, cols = BLOCK
    tiles = torch.zeros(-(-out // rows), -(-inp // cols))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            tiles[i, j] = tile.abs().amax() / E4M3_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (tile / tiles[i, j]).to(torch.float8_e4m3fn)
    return {"weight": q, scale_name: tiles}


def dequantized_by_hand(pieces: dict[str, torch.Tensor]) -> torch.Tensor:
    q = pieces["weight"].float()
    scale = pieces.get("weight_scale", pieces.get("weight_scale_inv"))
    assert scale is not None
    scale = scale.float()
    if scale.numel() == 1:
        return q * scale.item()
    if scale.shape == (q.shape[0], 1):
        return q * scale
    w = torch.empty_like(q)
    rows, cols = BLOCK
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            w[tile] = q[tile] * scale[i, j]
    return w


def compressed(strategy: str, **weights: Any) -> dict[str, Any]:
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}}}


CHECKPOINTS = {
    "compressed-channel": (compressed("channel"), channel_weight),
    "compressed-tensor": (compressed("tensor"), tensor_weight),
    "compressed-block": (compressed("block", block_structure=list(BLOCK)), lambda w: block_weight(w, "weight_scale")),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": list(BLOCK)}, lambda w: block_weight(w, "weight_scale_inv")),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def fp8_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The FP8 checkpoint (scales and weights in two files, a static input_scale beside some
    modules) and transformers' model on the weights dequantized by hand."""
    quantization, quantize = CHECKPOINTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    float_dir = build_tiny_model(root / "float", "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    files: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                 "model-00002-of-00002.safetensors": {}}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            module = name.removesuffix(".weight")
            if module.rpartition(".")[2] not in PROJECTIONS:
                files["model-00001-of-00002.safetensors"][name] = param.data.clone()
                continue
            pieces = quantize(param.data)
            for piece, tensor in pieces.items():
                files[f"model-0000{2 if piece == 'weight' else 1}-of-00002.safetensors"][f"{module}.{piece}"] = tensor
            if module.endswith("o_proj"):
                files["model-00001-of-00002.safetensors"][f"{module}.input_scale"] = torch.ones(1)
            param.copy_(dequantized_by_hand(pieces))
    quant_dir = root / "fp8"
    config = json.loads((float_dir / "config.json").read_text())
    write_checkpoint(quant_dir, {**config, "quantization_config": quantization}, files)
    return quant_dir, reference


@torch.inference_mode()
def test_fp8_llama_serves_the_dequantized_models_logits(fp8_llama) -> None:
    path, reference = fp8_llama
    config = load_config(path)
    assert isinstance(checkpoint_quantization(config), Fp8Format)
    model = load_model(path, config, torch.float32, TEST_DEVICE)
    prompts = [[5, 17, 33, 2, 250, 9, 71], [100, 3, 44]]
    run = prefill_every_position(model, prompts, 0, TEST_DEVICE)
    for prompt, logits in zip(prompts, run.logits, strict=True):
        torch.testing.assert_close(logits, reference(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


def test_fp8_weights_may_be_requantized_at_load(fp8_llama) -> None:
    """Dense after load, an FP8 checkpoint takes --quantize (an AWQ or GPTQ one refuses it)."""
    path, _ = fp8_llama
    model = load_model(path, load_config(path), torch.float32, TEST_DEVICE, quantize=QuantizeSpec("int8"))
    assert all(m.quant_weight is not None for m in model.modules() if isinstance(m, Linear))


CONFIGS_READ = {
    "compressed-channel": (compressed("channel"), Fp8Format("compressed-tensors", "channel")),
    "compressed-block": (compressed("block", block_structure=[128, 128]),
                         Fp8Format("compressed-tensors", "block", (128, 128))),
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, Fp8Format("fp8", "block", (128, 128))),
    "fp8-per-tensor": ({"quant_method": "fp8"}, Fp8Format("fp8", "tensor")),
}


@pytest.mark.parametrize("name", list(CONFIGS_READ))
def test_fp8_configs_read(name: str) -> None:
    config, expected = CONFIGS_READ[name]
    assert checkpoint_quantization({"quantization_config": config}) == expected


REFUSED = {
    "int-weights": ({**compressed("channel"), "format": "pack-quantized"}, "format 'pack-quantized'"),
    "int8-scheme": ({**compressed("channel"), "format": "float-quantized",
                     "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
                    "type 'int'"),
    "fp4": ({**compressed("channel"), "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float",
                                                                          "strategy": "group"}}}}, "4 bits"),
    "group-strategy": (compressed("group"), "strategy 'group'"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2'"),
    "bad-block": ({"quant_method": "fp8", "weight_block_size": [128]}, "block size"),
    "mixed-groups": ({**compressed("channel"), "config_groups": {
        "a": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}, "different weight schemes"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_fp8_variants_not_served_are_refused_by_name(name: str) -> None:
    config, message = REFUSED[name]
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization({"quantization_config": config})


def test_fp8_pieces_missing_or_misplaced_are_named() -> None:
    fmt = Fp8Format("compressed-tensors", "channel")
    q = torch.ones(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="layers.0.q_proj lacks its scale"):
        list(dequantized_fp8_tensors([("layers.0.q_proj.weight", q)], fmt))
    with pytest.raises(ValueError, match="lacks its float8 weight"):
        list(dequantized_fp8_tensors([("layers.0.q_proj.weight_scale", torch.ones(4, 1))], fmt))
    with pytest.raises(ValueError, match="per-channel scale has 4 elements"):
        list(dequantized_fp8_tensors([("p.weight", q), ("p.weight_scale", torch.ones(3, 1))], fmt))
    with pytest.raises(ValueError, match="no quantized projection's weight"):
        list(dequantized_fp8_tensors([("embed.table", q)], fmt))
    e5m2 = torch.ones(4, 8).to(torch.float8_e5m2)  # not what the config declares: never loaded unscaled
    with pytest.raises(ValueError, match="served in e4m3"):
        list(dequantized_fp8_tensors([("p.weight", e5m2), ("p.weight_scale", torch.ones(4, 1))], fmt))
