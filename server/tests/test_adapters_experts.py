"""Adapters on a sparse model's router and experts, read as peft reads them: which (layer,
projection) pairs an adapter_config.json targets equals what peft itself wraps, and adapters we
cannot apply exactly are refused with a message that names the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_adapters import build_adapter
from tiny_models import build_tiny_model

from quiver_server.adapters.peft_config import parse_lora_config, resolve_targets
from quiver_server.engine.engine import Engine

MAX_RANK = 16
# PEFT's fused expert parameters -> the projections we serve them as.
PARAMETER_TARGETS = {
    "gate_up_proj": ("experts.gate_proj", "experts.up_proj"),
    "down_proj": ("experts.down_proj",),
    "weight": ("gate",),  # a ParamWrapper on the router module
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"), "qwen3_moe", seed=5)


@pytest.fixture(scope="module")
def engine(base_dir: Path) -> Engine:
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(64, 64, 4, max_active_adapters=1, max_lora_rank=MAX_RANK)
    return engine


def _peft_wrapped(base_dir: Path, **config: Any) -> set[tuple[int, str]]:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    wrapped = set()
    for name, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        parts = name.replace(".base_layer", "").split(".")
        layer = int(parts[parts.index("layers") + 1])
        if isinstance(module, peft.tuners.lora.ParamWrapper):
            wrapped.update((layer, target) for target in PARAMETER_TARGETS[module.parameter_name])
        else:
            wrapped.add((layer, parts[-1]))
    return wrapped


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": "all-linear"},
        {"target_modules": ["q_proj"], "target_parameters": ["experts.down_proj"]},
        {"target_modules": [], "target_parameters": ["mlp.gate.weight", "experts.gate_up_proj"]},
        {"target_modules": ["k_proj"], "target_parameters": ["layers.1.mlp.experts.gate_up_proj"]},
    ],
    ids=["all-linear", "down", "router-gate-up", "one-layer"],
)
def test_targets_resolve_as_peft_wraps_them(engine: Engine, base_dir: Path, config: dict) -> None:
    expected = _peft_wrapped(base_dir, r=4, **config)
    raw = {"r": 4, "lora_alpha": 8, **config}
    assert resolve_targets(parse_lora_config(raw), engine.lora.spec) == expected


def test_per_module_rank_and_alpha_load_as_peft_sets_them(engine: Engine, base_dir: Path, tmp_path: Path) -> None:
    path = build_adapter(base_dir, tmp_path / "patterns", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"],
                         target_parameters=["experts.down_proj"], rank_pattern={"q_proj": 2},
                         alpha_pattern={"q_proj": 6})
    info = engine.lora.load("patterns", "local", str(path))
    assert info.rank == 4 and info.scaling == 2.0
    weights = engine.lora.registry.get("patterns").weights
    a, b = weights[(0, "q_proj")]
    reference = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), path)
    q_proj = reference.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.r["default"] == 2 and q_proj.scaling["default"] == 3.0
    # Served with the adapter's scaling (2.0): the module's own (3.0) is folded into B.
    torch.testing.assert_close(2.0 * b @ a, q_proj.get_delta_weight("default"), atol=1e-6, rtol=0)


def _rewrite(path: Path, config: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
    if config is not None:
        raw = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors, str(path / "adapter_model.safetensors"))


def test_expert_adapters_that_do_not_fit_are_refused(engine: Engine, base_dir: Path, tmp_path: Path) -> None:
    path = build_adapter(base_dir, tmp_path / "unknown-parameter", seed=4, r=4, target_modules=["q_proj"],
                         target_parameters=["experts.down_proj"])
    _rewrite(path, config={"target_parameters": ["experts.up_gate"]})
    with pytest.raises(ValueError, match="target_parameters 'experts.up_gate' matches none"):
        engine.lora.load("unknown-parameter", "local", str(path))

    path = build_adapter(base_dir, tmp_path / "wrong-rank", seed=4, r=4, target_modules=["q_proj"],
                         target_parameters=["experts.down_proj"])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if ".experts.lora_A" in k)
    tensors[key] = tensors[key][:-1]  # no longer r * experts rows
    _rewrite(path, tensors=tensors)
    with pytest.raises(ValueError, match=r"experts of shapes lora_A \(15, 32\).*fit none of the parameters"):
        engine.lora.load("wrong-rank", "local", str(path))

    path = build_adapter(base_dir, tmp_path / "dense-mlp", seed=4, r=4, target_modules=["q_proj"])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.zeros(32, 4)
    _rewrite(path, tensors=tensors)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj, which is not a LoRA-capable module"):
        engine.lora.load("dense-mlp", "local", str(path))
    assert "dense-mlp" not in engine.lora.registry
