"""AWQ and GPTQ checkpoints as `QuantizedWeight`s (`quant.prequantized`), against packers written
here from the formats' published layouts — field by field with explicit shifts, apart from the
unpacker — and the formats' definition w = (q - zero) * scale computed in float64 from the
original integers:

- AWQ GEMM: qweight [in, out/8], word c's field i (bits 4i..4i+3) holds output column
  8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros [in/group, out/8] the same; scales [in/group, out].
- GPTQ: qweight [in*bits/32, out], word r's field j holds input r*32/bits + j; qzeros
  [in/group, out*bits/32], word c's field j holds output c*32/bits + j; v1 ("gptq") stores
  zero - 1, v2 the zero; g_idx [in] each input's group.

The pieces come shuffled among float tensors; each module must come out exact (every weight is a
16-bit scale times a small integer, so float32 holds it). Then a tiny Llama's projections
written as an AWQ checkpoint: each dequantized weight is within the quantization error of its
float weight, and served through quiver's model it gives transformers' logits on the dequantized
weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from device import TEST_DEVICE
from quant_cases import prefill_every_position, write_checkpoint
from tiny_models import build_tiny_model

from quiver_server.layers.linear import Linear
from quiver_server.models import load_model
from quiver_server.quant import prequantized
from quiver_server.quant.prequantized import PrequantizedFormat, checkpoint_quantization, group_quantized_tensors
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.quant.weights import QuantizedWeight
from quiver_server.weights import iter_tensors, load_config

AWQ_FIELD_COLUMN = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_awq(values: np.ndarray) -> torch.Tensor:
    """[rows, cols] 4-bit values -> int32 [rows, cols/8]: field i of word c is column 8c + AWQ_FIELD_COLUMN[i]."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for c in range(cols // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + AWQ_FIELD_COLUMN[i]].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def pack_gptq_rows(values: np.ndarray, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows*bits/32, cols]: field j of word r is row r*32/bits + j."""
    per_word = 32 // bits
    words = np.zeros((values.shape[0] // per_word, values.shape[1]), dtype=np.uint32)
    for r in range(words.shape[0]):
        for j in range(per_word):
            words[r] |= values[r * per_word + j].astype(np.uint32) << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def pack_gptq_columns(values: np.ndarray, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols*bits/32]: field j of word c is column c*32/bits + j."""
    per_word = 32 // bits
    words = np.zeros((values.shape[0], values.shape[1] // per_word), dtype=np.uint32)
    for c in range(words.shape[1]):
        for j in range(per_word):
            words[:, c] |= values[:, c * per_word + j].astype(np.uint32) << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def pack_gptq_v1_zeros_by_word(zeros: np.ndarray, bits: int) -> torch.Tensor:
    """GPTQModel's v1 zeros: the v2 word minus one in every field, as one integer subtraction (a
    zero of 0 borrows from the field above), modulo 2**32."""
    per_word = 32 // bits
    words = np.zeros((zeros.shape[0], zeros.shape[1] // per_word), dtype=np.int64)
    for c in range(words.shape[1]):
        for j in range(per_word):
            words[:, c] += (zeros[:, c * per_word + j] - 1) * (1 << (bits * j))
    return torch.from_numpy((words % (1 << 32)).astype(np.uint32).view(np.int32))


@dataclasses.dataclass
class Module:
    """One quantized [out, in] weight: integers q [out, in], zeros and fp16 scales [out, groups]."""

    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    group: int

    def reference(self) -> torch.Tensor:
        """(q - zero) * scale in float64, each input k in group k // group."""
        g = np.arange(self.q.shape[1]) // self.group
        return torch.from_numpy((self.q - self.zeros[:, g]) * self.scales.astype(np.float64)[:, g])


def random_module(rng: np.random.Generator, out: int, inp: int, group: int, bits: int = 4,
                  zeros: tuple[int, int] = (0, 16)) -> Module:
    groups = inp // group
    scales = (rng.uniform(0.001, 0.05, (out, groups))).astype(np.float16)
    return Module(rng.integers(0, 1 << bits, (out, inp)), rng.integers(*zeros, (out, groups)), scales, group)


def awq_tensors(name: str, m: Module) -> dict[str, torch.Tensor]:
    return {f"{name}.qweight": pack_awq(m.q.T), f"{name}.qzeros": pack_awq(m.zeros.T),
            f"{name}.scales": torch.from_numpy(m.scales.T.copy())}


def gptq_tensors(name: str, m: Module, bits: int = 4, v1: bool = False, g_idx: bool = True) -> dict[str, torch.Tensor]:
    tensors = {f"{name}.qweight": pack_gptq_rows(m.q.T, bits),
               f"{name}.qzeros": pack_gptq_columns((m.zeros - 1 if v1 else m.zeros).T, bits),
               f"{name}.scales": torch.from_numpy(m.scales.T.copy())}
    if g_idx:
        tensors[f"{name}.g_idx"] = torch.arange(m.q.shape[1], dtype=torch.int32) // m.group
    return tensors


def floats(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(8, 8, generator=generator)
            for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.down_proj.bias")}


def grouped(tensors: dict[str, torch.Tensor], fmt: PrequantizedFormat, seed: int = 0,
            ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """`tensors` shuffled among float tensors through group_quantized_tensors; the floats must pass as they are."""
    extra = floats(seed)
    items = list({**tensors, **extra}.items())
    random.Random(seed).shuffle(items)
    out = list(group_quantized_tensors(items, fmt))
    result = dict(out)
    assert len(result) == len(out), "a name came out twice"
    for name, tensor in extra.items():
        assert result.pop(name) is tensor
    return result


def assert_exact(weight: torch.Tensor | QuantizedWeight, m: Module, bits: int = 4) -> None:
    assert isinstance(weight, QuantizedWeight)
    assert (weight.bits, weight.group_size, weight.q.shape) == (bits, m.group, m.q.shape)
    assert torch.equal(weight.dequantize().double(), m.reference())
    if bits == 4:
        assert torch.equal(weight.q.long(), torch.from_numpy(m.q))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_gemm_modules_come_out_exact_whatever_the_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    modules = {"model.layers.0.self_attn.q_proj": random_module(rng, 64, 256, 32),
               "model.layers.0.mlp.down_proj": random_module(rng, 96, 128, 32),
               "lm_head": random_module(rng, 16, 32, 32)}  # a single group
    tensors = {k: v for name, m in modules.items() for k, v in awq_tensors(name, m).items()}
    out = grouped(tensors, PrequantizedFormat("awq", 4, 32), seed)
    assert out.keys() == {f"{name}.weight" for name in modules}
    for name, m in modules.items():
        assert_exact(out[f"{name}.weight"], m)


def test_awq_interleaved_modules_stream_as_each_completes() -> None:
    rng = np.random.default_rng(3)
    a, b = random_module(rng, 32, 64, 32), random_module(rng, 16, 64, 32)
    ta, tb = awq_tensors("a", a), awq_tensors("b", b)
    bias = torch.ones(3)
    items = [("a.qweight", ta["a.qweight"]), ("b.scales", tb["b.scales"]), ("a.scales", ta["a.scales"]),
             ("b.qweight", tb["b.qweight"]), ("a.qzeros", ta["a.qzeros"]), ("a.bias", bias),
             ("b.qzeros", tb["b.qzeros"])]
    out = list(group_quantized_tensors(items, PrequantizedFormat("awq", 4, 32)))
    assert [name for name, _ in out] == ["a.weight", "a.bias", "b.weight"]
    assert_exact(out[0][1], a)
    assert out[1][1] is bias
    assert_exact(out[2][1], b)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v2_zero_points_are_stored_as_they_are(bits: int) -> None:
    rng = np.random.default_rng(bits)
    m = random_module(rng, 64, 256, 32, bits, zeros=(0, 1 << bits))
    out = grouped(gptq_tensors("m", m, bits), PrequantizedFormat("gptq", bits, 32), seed=bits)
    assert_exact(out["m.weight"], m, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_stores_zero_minus_one(bits: int) -> None:
    rng = np.random.default_rng(10 + bits)
    m = random_module(rng, 64, 256, 64, bits, zeros=(1, 1 << bits))  # AutoGPTQ's range: never a stored -1
    out = grouped(gptq_tensors("m", m, bits, v1=True),
                  PrequantizedFormat("gptq", bits, 64, zeros_minus_one=True), seed=bits)
    assert_exact(out["m.weight"], m, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_point_of_zero_as_gptqmodel_writes_it(bits: int) -> None:
    rng = np.random.default_rng(20 + bits)
    m = random_module(rng, 64, 128, 32, bits)
    m.zeros[::3] = 0  # stored -1: borrows from the field above, and in a word's top field wraps
    m.zeros[32 // bits - 1 :: 32 // bits] = 0
    tensors = gptq_tensors("m", m, bits)
    tensors["m.qzeros"] = pack_gptq_v1_zeros_by_word(m.zeros.T, bits)
    out = grouped(tensors, PrequantizedFormat("gptq", bits, 32, zeros_minus_one=True))
    assert_exact(out["m.weight"], m, bits)


def test_gptq_group_size_minus_one_is_one_group_per_row() -> None:
    rng = np.random.default_rng(4)
    m = random_module(rng, 48, 256, 256, zeros=(1, 16))
    fmt = checkpoint_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                                           "desc_act": False, "sym": False}})
    assert fmt == PrequantizedFormat("gptq", 4, -1, zeros_minus_one=True)
    out = grouped(gptq_tensors("m", m, v1=True), fmt)
    assert_exact(out["m.weight"], m)


def test_fewer_inputs_than_a_group_make_one_group() -> None:
    rng = np.random.default_rng(12)
    m = random_module(rng, 32, 64, 64)
    assert_exact(grouped(gptq_tensors("m", m), PrequantizedFormat("gptq", 4, 128))["m.weight"], m)
    assert_exact(grouped(awq_tensors("m", m), PrequantizedFormat("awq", 4, 128))["m.weight"], m)


def test_gptq_symmetric_checkpoints_store_their_zero_points() -> None:
    rng = np.random.default_rng(5)
    m = random_module(rng, 32, 128, 32)
    m.zeros[:] = 8
    tensors = gptq_tensors("m", m, v1=True)
    assert (tensors["m.qzeros"] == 0x77777777).all()  # the familiar v1 sym word
    fmt = checkpoint_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                           "sym": True, "checkpoint_format": "gptq"}})
    assert fmt is not None
    assert_exact(grouped(tensors, fmt)["m.weight"], m)


def test_gptq_8_bit_symmetric_needs_no_offsets() -> None:
    rng = np.random.default_rng(6)
    m = random_module(rng, 32, 64, 32, bits=8)
    m.zeros[:] = 128
    out = grouped(gptq_tensors("m", m, 8), PrequantizedFormat("gptq", 8, 32))["m.weight"]
    assert isinstance(out, QuantizedWeight) and out.offsets is None
    assert_exact(out, m, 8)


def test_gptq_without_g_idx_comes_at_the_end() -> None:
    rng = np.random.default_rng(7)
    m = random_module(rng, 32, 64, 32)
    tensors = gptq_tensors("m", m, g_idx=False)
    bias = torch.zeros(2)
    out = list(group_quantized_tensors([*tensors.items(), ("m.bias", bias)], PrequantizedFormat("gptq", 4, 32)))
    assert [name for name, _ in out] == ["m.bias", "m.weight"]
    assert_exact(out[1][1], m)


def test_act_order_is_refused_unless_g_idx_keeps_input_order() -> None:
    rng = np.random.default_rng(8)
    m = random_module(rng, 32, 128, 32)
    fmt = checkpoint_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                           "desc_act": True, "checkpoint_format": "gptq_v2"}})
    assert fmt == PrequantizedFormat("gptq", 4, 32, act_order=True)
    # desc_act with static_groups: groups in input order, so it loads.
    assert_exact(grouped(gptq_tensors("m", m), fmt)["m.weight"], m)
    shuffled = gptq_tensors("m", m)
    shuffled["m.g_idx"] = shuffled["m.g_idx"][torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ValueError, match=r"m: act-order \(desc_act\).*not supported"):
        grouped(shuffled, fmt)
    with pytest.raises(ValueError, match="m lacks g_idx"):
        grouped(gptq_tensors("m", m, g_idx=False), fmt)


def test_incomplete_duplicate_and_misplaced_pieces_are_named() -> None:
    rng = np.random.default_rng(9)
    m = random_module(rng, 32, 64, 32)
    awq = PrequantizedFormat("awq", 4, 32)
    tensors = awq_tensors("model.layers.0.mlp.up_proj", m)
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj lacks qzeros"):
        grouped(tensors, awq)
    with pytest.raises(ValueError, match=r"o_proj lacks qweight, qzeros"):
        grouped({"x.o_proj.scales": torch.ones(2, 32, dtype=torch.float16)}, awq)
    tensors = awq_tensors("m", m)
    with pytest.raises(ValueError, match=r"m\.scales appears twice"):
        list(group_quantized_tensors([*tensors.items(), ("m.scales", tensors["m.scales"])], awq))
    with pytest.raises(ValueError, match="AWQ checkpoints have no g_idx"):
        grouped({**tensors, "m.g_idx": torch.zeros(64, dtype=torch.int32)}, awq)


def test_shapes_that_disagree_with_the_config_are_refused() -> None:
    rng = np.random.default_rng(11)
    m = random_module(rng, 32, 128, 32)
    with pytest.raises(ValueError, match=r"m\.scales has 4 groups for 128 inputs; group_size 64 makes 2"):
        grouped(awq_tensors("m", m), PrequantizedFormat("awq", 4, 64))
    with pytest.raises(ValueError, match="partial group"):
        grouped(gptq_tensors("m", random_module(rng, 32, 96, 48)), PrequantizedFormat("gptq", 4, 64))
    tensors = gptq_tensors("m", m)
    tensors["m.qzeros"] = tensors["m.qzeros"][:, :2]
    with pytest.raises(ValueError, match=r"m\.qzeros has shape \(4, 2\), expected \(4, 4\)"):
        grouped(tensors, PrequantizedFormat("gptq", 4, 32))
    tensors = awq_tensors("m", m)
    tensors["m.qweight"] = tensors["m.qweight"].float()
    with pytest.raises(ValueError, match="int32 words"):
        grouped(tensors, PrequantizedFormat("awq", 4, 32))


# config.json quantization_config -> the format read from it
READ = {
    "autoawq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
                PrequantizedFormat("awq", 4, 128)),
    "autoawq-upper-case": ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"},
                           PrequantizedFormat("awq", 4, 64)),
    "transformers-awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "format": "gemm", "version": "gemm",
                          "backend": "autoawq", "modules_to_not_convert": ["gate"]}, PrequantizedFormat("awq", 4, 32)),
    "autogptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                  "damp_percent": 0.01, "true_sequential": True}, PrequantizedFormat("gptq", 4, 128, True)),
    "gptqmodel-v2": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "format": "gptq_v2", "sym": False,
                      "pack_dtype": "int32", "dynamic": {"-:.*lm_head": {}}}, PrequantizedFormat("gptq", 8, 32)),
    "optimum": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq", "format": "gptq",
                 "desc_act": True}, PrequantizedFormat("gptq", 4, -1, True, act_order=True)),
}


@pytest.mark.parametrize("name", list(READ))
def test_configs_read(name: str) -> None:
    config, expected = READ[name]
    assert checkpoint_quantization({"model_type": "llama", "quantization_config": config}) == expected


def test_no_quantization_config_is_none() -> None:
    assert checkpoint_quantization({"model_type": "llama"}) is None


# quantization_config -> what the refusal must say
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "hqq": ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    "awq-exllama": ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "AWQ version 'exllama'"),
    "awq-marlin": ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "AWQ version 'marlin'"),
    "awq-gemv-fast": ({"quant_method": "awq", "bits": 4, "format": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    "llm-awq": ({"quant_method": "awq", "bits": 4, "backend": "llm-awq"}, "AWQ version 'llm-awq'"),
    "awq-8-bit": ({"quant_method": "awq", "bits": 8}, "AWQ with bits=8"),
    "awq-no-zero-point": ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point: false"),
    "gptq-2-bit": ({"quant_method": "gptq", "bits": 2}, "GPTQ with bits=2"),
    "gptq-3-bit": ({"quant_method": "gptq", "bits": 3}, "GPTQ with bits=3"),
    "gptq-marlin": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                    "GPTQ checkpoint_format 'marlin'"),
    "gptq-bitblas": ({"quant_method": "gptq", "bits": 4, "format": "bitblas"}, "GPTQ checkpoint_format 'bitblas'"),
    "gptq-is-marlin": ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "'marlin'"),
    "gptq-int64-words": ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int64"}, "int64 words"),
    "gptq-dynamic-bits": ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down_proj": {"bits": 8}}},
                          "per-module GPTQ formats"),
    "bad-group-size": ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_quantization_is_refused_saying_what_is_served(name: str) -> None:
    config, message = REFUSED[name]
    with pytest.raises(ValueError, match=message) as error:
        checkpoint_quantization({"quantization_config": config})
    # A method or variant served under no name says what is; the finer GPTQ refusals say what the config has.
    if name not in ("gptq-int64-words", "gptq-dynamic-bits", "bad-group-size"):
        assert prequantized.SUPPORTED in str(error.value)


# -- a tiny Llama as an AWQ checkpoint ---------------------------------------------------------------

GROUP = 32


def awq_quantize(w: torch.Tensor) -> Module:
    """AutoAWQ's rounding (zero point, fp16 scales) of a float [out, in] weight, in groups of GROUP."""
    out, inp = w.shape
    g = w.double().view(out, inp // GROUP, GROUP)
    low, high = g.amin(dim=2), g.amax(dim=2)
    scales = ((high - low) / 15).to(torch.float16)
    s = scales.double()
    zeros = torch.round(-low / s).clamp(0, 15)
    q = (torch.round(g / s.unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0, 15).view(out, inp)
    return Module(q.long().numpy(), zeros.long().numpy(), scales.numpy(), GROUP)


@pytest.fixture(scope="module")
def awq_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel, dict[str, Any]]:
    """An AWQ checkpoint of a tiny Llama (two files: every qweight in one, the rest in the other, so each
    module completes only in the second) and transformers' model on its dequantized weights."""
    root = tmp_path_factory.mktemp("awq-llama")
    float_dir = build_tiny_model(root / "float", "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    files: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                 "model-00002-of-00002.safetensors": {}}
    originals: dict[str, Any] = {}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            module = name.removesuffix(".weight")
            if module.rpartition(".")[2] in PROJECTIONS:
                m = awq_quantize(param.data)
                originals[module] = (param.data.clone(), m)
                for key, tensor in awq_tensors(module, m).items():
                    files[f"model-0000{1 if key.endswith('qweight') else 2}-of-00002.safetensors"][key] = tensor
                param.copy_(m.reference().float())
            else:
                originals[name] = param.data.clone()
                files["model-00001-of-00002.safetensors"][name] = param.data.clone()
    quant_dir = root / "awq"
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    write_checkpoint(quant_dir, config, files)
    return quant_dir, reference, originals


def test_awq_llama_weights_are_their_float_weights_within_the_rounding(
    awq_llama: tuple[Path, transformers.PreTrainedModel, dict[str, Any]],
) -> None:
    path, _, originals = awq_llama
    fmt = checkpoint_quantization(load_config(path))
    assert fmt == PrequantizedFormat("awq", 4, GROUP)
    loaded = dict(group_quantized_tensors(iter_tensors(path, torch.device("cpu")), fmt))
    assert loaded.keys() == {name if name.endswith("weight") else f"{name}.weight" for name in originals}
    quantized = 0
    for name, original in originals.items():
        if isinstance(original, torch.Tensor):
            tensor = loaded[name]
            assert isinstance(tensor, torch.Tensor) and torch.equal(tensor, original)
            continue
        w, m = original
        weight = loaded[f"{name}.weight"]
        assert_exact(weight, m)
        assert isinstance(weight, QuantizedWeight)
        # Rounding to the nearest step: half a scale, a hair more where the fp16-rounded scale
        # pushes a group's top value past 15 and it clamps.
        error = (weight.dequantize() - w).abs().view(w.shape[0], -1, GROUP)
        assert (error <= weight.scales.unsqueeze(2) * 0.51).all()
        quantized += 1
    assert quantized == 2 * len(PROJECTIONS)


@torch.inference_mode()
def test_awq_llama_served_gives_the_dequantized_models_logits(
    awq_llama: tuple[Path, transformers.PreTrainedModel, dict[str, Any]],
) -> None:
    """The shard's own loader on the AWQ checkpoint (config.json's quantization_config read, the
    packed tensors unpacked into quantized projections) against transformers on its
    dequantized weights; --quantize on top of it is refused."""
    path, reference, _ = awq_llama
    config = load_config(path)
    model = load_model(path, config, torch.float32, TEST_DEVICE)
    assert all(m.quant_weight is not None for m in model.modules() if isinstance(m, Linear))
    with pytest.raises(ValueError, match="already quantized"):
        load_model(path, config, torch.float32, TEST_DEVICE, quantize=QuantizeSpec("int8"))
    prompts = [[5, 17, 33, 2, 250, 9, 71], [100, 3, 44]]
    run = prefill_every_position(model, prompts, 0, TEST_DEVICE)
    for prompt, logits in zip(prompts, run.logits, strict=True):
        torch.testing.assert_close(logits, reference(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)
