"""`--quantize int8|int4` end to end in the shard's model: served from the float checkpoint with
its projections quantized at load, the logits must be transformers' on the *dequantized*
checkpoint — the same weights rounded the way the formats promise, re-derived here from the
documented rules (int8: per-output-channel symmetric, scale = max|w| / 127; int4: groups of 128
inputs, or the largest power of two down to 32 that divides the width, scale = (max - min) / 15,
offset = min) rather than taken from quiver's quantizer.

`--quantize-lm-head` quantizes the LM head the same way (a copy where it is tied). Also what
each path leaves in the model: the projections hold packed quantized weights (no float
copy), and the embeddings and LM head stay float.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from device import TEST_DEVICE
from quant_cases import prefill_every_position
from tiny_models import build_tiny_model

from quiver_server.engine.forward_batch import build_decode
from quiver_server.engine.kv_cache import BLOCK_SIZE
from quiver_server.layers.linear import Linear
from quiver_server.models import load_model
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.weights import load_config

# Quantized weights change logits by ~1e-2 from the float model, so agreeing with the
# dequantized reference to 1e-4 shows the served weights are exactly the dequantized ones.
ATOL = 1e-4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _group(width: int, wanted: int) -> int:
    """The documented rule: the wanted group, else the largest power of two below it down to 32
    that divides the width, else the whole row."""
    for group in [wanted] + [g for g in (64, 32) if g < wanted]:
        if width % group == 0:
            return group
    return width


def dequantized_int8(w: torch.Tensor) -> torch.Tensor:
    w64 = w.double()
    scale = (w64.abs().amax(dim=1, keepdim=True) / 127).float().double()
    return (torch.round(w64 / scale).clamp(-127, 127) * scale).float()


def dequantized_int4(w: torch.Tensor, wanted_group: int = 128) -> torch.Tensor:
    out, width = w.shape
    group = _group(width, wanted_group)
    g = w.double().view(out, width // group, group)
    low, high = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = ((high - low).float() / 15).double()  # float32 scales, as stored
    q = torch.round((g - low) / scale).clamp(0, 15)
    return (q * scale + low).float().view(out, width)


def dequantize(w: torch.Tensor, spec: QuantizeSpec) -> torch.Tensor:
    return dequantized_int8(w) if spec.method == "int8" else dequantized_int4(w, spec.group_size)


# case -> (architecture, QuantizeSpec, model options)
CASES = {"llama-int8": ("llama", QuantizeSpec("int8"), {}), "llama-int4": ("llama", QuantizeSpec("int4"), {}),
         "llama-int4-group-128": ("llama", QuantizeSpec("int4", 128), {}),
         "qwen2-bias-int4": ("qwen2", QuantizeSpec("int4"), {}),
         "llama-tied-int8": ("llama", QuantizeSpec("int8"), {"tie_word_embeddings": True}),
         "llama-int8-lm-head": ("llama", QuantizeSpec("int8", lm_head=True), {}),
         # The head a quantized copy; the embedding lookup keeps the float table.
         "llama-tied-int4-lm-head": ("llama", QuantizeSpec("int4", 32, lm_head=True), {"tie_word_embeddings": True})}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, QuantizeSpec, object]:
    arch, spec, kwargs = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path = build_tiny_model(root / "float", arch, seed=list(CASES).index(request.param), **kwargs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS and name.endswith(".weight"):
                param.copy_(dequantize(param, spec))
        if spec.lm_head:  # untied in the reference: its embeddings stay float, as served
            reference.lm_head.weight = torch.nn.Parameter(dequantize(reference.lm_head.weight, spec))
    return path, spec, reference


@torch.inference_mode()
def test_quantized_model_gives_the_dequantized_models_logits(
    case: tuple[Path, QuantizeSpec, transformers.PreTrainedModel],
) -> None:
    path, spec, reference = case
    model = load_model(path, load_config(path), torch.float32, TEST_DEVICE, quantize=spec)
    cfg = model.config
    rng = random.Random(5)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 19)]
    run = prefill_every_position(model, prompts, 3, TEST_DEVICE)
    for prompt, logits in zip(prompts, run.logits, strict=True):
        torch.testing.assert_close(logits, reference(torch.tensor([prompt])).logits[0], atol=ATOL, rtol=0)
    sequences = [list(p) for p in prompts]
    for step in range(3):
        fed = [(13 * step + 7 * i + 5) % cfg.vocab_size for i in range(len(sequences))]
        batch = build_decode([len(s) for s in sequences], run.table.to(TEST_DEVICE), BLOCK_SIZE, TEST_DEVICE)
        logits = model(torch.tensor(fed, device=TEST_DEVICE), batch, run.kv_cache).cpu()
        for i, token in enumerate(fed):
            sequences[i].append(token)
            expected = reference(torch.tensor([sequences[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


def test_quantized_projections_keep_no_float_copy_and_the_head_stays_float(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "llama", "llama")
    model = load_model(path, load_config(path), torch.float32, TEST_DEVICE, quantize=QuantizeSpec("int4"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.quant_weight is not None for m in linears)
    assert all(m.quant_weight.bits == 4 for m in linears if m.quant_weight is not None)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    head = model.lm_head_packed if model.lm_head_packed is not None else model.lm_head.weight
    assert head is not None


def test_int4_groups_follow_the_documented_rule() -> None:
    """Default 32 (llama.cpp's Q4 block); a wanted group that does not divide the width falls back."""
    for width, wanted in [(96, None), (96, 128), (576, 128), (48, 16), (40, 16), (40, 128), (160, 64)]:
        spec = QuantizeSpec("int4") if wanted is None else QuantizeSpec("int4", wanted)
        weight = spec.apply(torch.randn(8, width))
        assert weight.group_size == _group(width, wanted or 32), (width, wanted)
    assert QuantizeSpec("int4").group_size == 32


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="int3"):
        QuantizeSpec("int3")
    with pytest.raises(ValueError, match="power of two"):
        QuantizeSpec("int4", 48)
