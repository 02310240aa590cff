"""`--quantize-activations int8` in the shard's model: a tiny llama quantized at load (int8 per
output channel; int4 in groups of 32 with offsets). Through a prefill and decode steps, every
projection must compute the documented definition in float64 on its inputs, with the weight
re-derived here from the float checkpoint (not from quiver's quantizer or kernel):

    y = sum over blocks of 32 inputs of  d * (s * (q . a)  +  o * sum(a))  (+ bias),
    a = round(x * (127 / max|x|)), d = max|x| / 127 (per row and block)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers
from quant_cases import prefill_every_position
from tiny_models import build_tiny_model

from quiver_server.engine.forward_batch import build_decode
from quiver_server.engine.kv_cache import BLOCK_SIZE
from quiver_server.kernels.ops import select_ops
from quiver_server.layers.linear import Linear
from quiver_server.models import load_model
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.weights import load_config

CPU = torch.device("cpu")
BLOCK = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(q, scale, offset or None, group) by the documented rules: int8 symmetric per output
    row (scale = max|w| / 127), int4 in groups of 32 (scale = (max - min) / 15, offset = min)."""
    w = w.float()
    if method == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(w / scale).clamp(-127, 127), scale, None, w.shape[1]
    g = w.view(w.shape[0], -1, BLOCK)
    low, high = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = (high - low) / 15
    q = torch.round((g - low) / scale).clamp(0, 15)
    return q.view_as(w), scale.squeeze(2), low.squeeze(2), BLOCK


def definition(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
               group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula above in float64 for rows x, and a bound on a float32 evaluation's error (the
    integer sums exact; a block's s * d or d * sum(a), its product and the sums over blocks rounded)."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = torch.round(blocks * inverse).double()
    d = (amax / 127.0).double().squeeze(2)
    per_block = scale.double().repeat_interleave(group // BLOCK, dim=1)
    terms = torch.einsum("rbk,obk->rob", a, q.double().view(q.shape[0], -1, BLOCK)) * d[:, None, :] * per_block[None]
    y, magnitude = terms.sum(2), terms.abs().sum(2)
    if offset is not None:
        offsets = offset.double().repeat_interleave(group // BLOCK, dim=1)
        offset_terms = (a.sum(2) * d)[:, None, :] * offsets[None]
        y, magnitude = y + offset_terms.sum(2), magnitude + offset_terms.abs().sum(2)
    u = 2.0**-24
    n = 2 * blocks.shape[1] + BLOCK + 4
    return y, (n * u / (1 - n * u) + u) * magnitude + u * y.abs()


@pytest.mark.parametrize("method", ["int8", "int4"])
@torch.inference_mode()
def test_every_projection_of_prefill_and_decode_computes_the_definition(tmp_path: Path, method: str) -> None:
    """Each served projection's output against the formula on the very inputs it was given: the
    model as a whole cannot be compared to a reference within a tolerance, since an input a float32
    rounding away from a rounding boundary of `a` moves the logits by ~1e-2."""
    # hidden 64 and intermediate 128 of the tiny shape: whole blocks of 32 everywhere.
    path = build_tiny_model(tmp_path / "llama", "llama", seed=11)
    model = load_model(path, load_config(path), torch.float32, CPU, select_ops(CPU, "int8"),
                       quantize=QuantizeSpec(method, 32))
    float_weights = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert {m.quant_weight.kernel for m in linears.values() if m.quant_weight is not None} == {"cpu-int8-dot"}
    for name, module in linears.items():
        module.register_forward_hook(lambda m, args, y, name=name: calls.append((name, args[0].clone(), y.clone())))
    cfg = model.config
    rng = random.Random(5)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 19)]
    run = prefill_every_position(model, prompts, 3, CPU)
    for step in range(3):
        fed = [(13 * step + 7 * i + 5) % cfg.vocab_size for i in range(len(prompts))]
        batch = build_decode([len(p) + step for p in prompts], run.table, BLOCK_SIZE, CPU)
        model(torch.tensor(fed), batch, run.kv_cache)
    assert {x.shape[0] for _, x, _ in calls} == {24, 2}  # the prefill's rows and the decode steps'
    assert len(calls) == 4 * len(linears)
    for name, x, y in calls:
        prefix = name.rpartition(".")[0]
        weight = torch.cat([float_weights[f"{prefix}.{part}.weight"] for part in linears[name].parts])
        q, scale, offset, group = quantized(weight, method)
        want, bound = definition(x, q, scale, offset, group)
        assert ((y.double() - want).abs() <= bound).all(), (name, (y.double() - want).abs().max())


def test_a_model_without_quantized_projections_is_refused(tmp_path: Path) -> None:
    from quiver_server.engine.engine import Engine

    path = build_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="needs quantized projections"):
        Engine(str(path), "tiny", device="cpu", quantize_activations="int8")
