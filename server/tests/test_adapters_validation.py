"""Reading adapters as peft writes them, and refusing the ones we cannot serve exactly.

Target resolution is checked against the modules peft itself wraps; weights against the
tensors peft loads; every mismatch with the base is a ValueError that names the difference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_adapters import build_adapter, peft_reference
from tiny_models import build_tiny_model

from quiver_server.adapters.errors import AdapterNotFoundError
from quiver_server.adapters.peft_config import parse_lora_config, read_lora_config, resolve_targets
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.engine.engine import Engine

MAX_RANK = 16


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=5)


@pytest.fixture(scope="module")
def engine(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # The adapter root holds every test's tmp_path, so refusals may quote the config of the base an
    # adapter names (read only inside the root: test_adapters_base_hint).
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01,
                    adapter_root=str(tmp_path_factory.getbasetemp()))
    engine.warmup(64, 64, 4, max_active_adapters=1, max_lora_rank=MAX_RANK)
    return engine


@pytest.fixture(scope="module")
def spec(engine: Engine) -> BaseModelSpec:
    return engine.lora.spec


def _peft_wrapped(base_dir: Path, **config: Any) -> set[tuple[int, str]]:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**config))
    wrapped = set()
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            parts = name.split(".")
            wrapped.add((int(parts[parts.index("layers") + 1]), parts[-1]))
    return wrapped


@pytest.mark.parametrize(
    "config",
    [
        {"target_modules": ["q_proj", "v_proj"]},
        {"target_modules": ["self_attn.o_proj", "model.layers.1.mlp.up_proj"]},
        {"target_modules": r".*layers\.1\..*_proj"},
        {"target_modules": r"model\.layers\.0\.(self_attn|mlp)\.(k|down)_proj"},
        {"target_modules": ["k_proj", "gate_proj"], "layers_to_transform": [0]},
        {"target_modules": ["k_proj", "gate_proj"], "layers_to_transform": 1, "layers_pattern": "layers"},
        {"target_modules": ["q_proj", "k_proj", "down_proj"], "exclude_modules": ["model.layers.0.self_attn.k_proj"]},
        {"target_modules": "all-linear"},
        {"target_modules": "all-linear", "exclude_modules": r".*\.mlp\..*"},
    ],
    ids=["names", "path-suffixes", "regex", "regex-anchored", "layers", "layers-pattern", "exclude", "all-linear",
         "all-linear-exclude-regex"],
)
def test_target_modules_resolve_as_peft_resolves_them(base_dir: Path, spec: BaseModelSpec, config: dict) -> None:
    raw = {"r": 4, "lora_alpha": 8, **config}
    assert resolve_targets(parse_lora_config(raw), spec) == _peft_wrapped(base_dir, r=4, **config)


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_weights_are_peft_s_weights(base_dir: Path, engine: Engine, tmp_path: Path, safe_serialization: bool) -> None:
    path = build_adapter(base_dir, tmp_path / "a", seed=1, r=8, lora_alpha=16,
                         target_modules=["q_proj", "down_proj"], safe_serialization=safe_serialization)
    assert (path / "adapter_model.bin").is_file() == (not safe_serialization)
    info = engine.lora.load(f"fmt-{safe_serialization}", "local", str(path))
    assert (info.rank, info.scaling, info.target_modules) == (8, 2.0, ["q_proj", "down_proj"])
    assert Path(info.path) == path.resolve()
    ours = engine.lora.registry.get(f"fmt-{safe_serialization}").weights
    reference = peft_reference(base_dir, path)
    for name, module in reference.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            parts = name.split(".")
            a, b = ours[(int(parts[parts.index("layers") + 1]), parts[-1])]
            torch.testing.assert_close(a, module.lora_A["default"].weight, atol=0, rtol=0)
            torch.testing.assert_close(b, module.lora_B["default"].weight, atol=0, rtol=0)


# ---- refusals --------------------------------------------------------------------------------


def _edit_config(path: Path, **changes: Any) -> None:
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))


def _edit_weights(path: Path, drop: str = "", add: dict[str, torch.Tensor] | None = None) -> None:
    weights_path = path / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(str(weights_path)).items() if not (drop and drop in k)}
    save_file({**tensors, **(add or {})}, str(weights_path))


def _other_base(tmp: Path, arch: str, **overrides: Any) -> Path:
    return build_tiny_model(tmp / f"other-{arch}", arch, seed=9, **overrides)


def _case(name: str, base_dir: Path, tmp: Path) -> Path:
    """Writes adapter `name` (one of REFUSALS) and returns its directory."""
    plain = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    if name == "hidden-size":
        other = _other_base(tmp, "llama", hidden_size=32, intermediate_size=64)
        return build_adapter(other, tmp / name, seed=2, **plain)
    if name == "hidden-size-no-base-hint":
        other = _other_base(tmp, "llama", hidden_size=32, intermediate_size=64)
        path = build_adapter(other, tmp / name, seed=2, **plain)
        _edit_config(path, base_model_name_or_path=None)
        return path
    if name == "model-type":
        return build_adapter(_other_base(tmp, "mistral"), tmp / name, seed=2, **plain)
    if name == "embed-tokens":
        return build_adapter(base_dir, tmp / name, seed=2, r=8, target_modules=["q_proj", "embed_tokens"])
    if name == "lm-head":
        return build_adapter(base_dir, tmp / name, seed=2, r=8, target_modules=["v_proj", "lm_head"])
    if name == "rank-over-max":
        return build_adapter(base_dir, tmp / name, seed=2, r=32, target_modules=["q_proj"])
    if name == "dora":
        return build_adapter(base_dir, tmp / name, seed=2, use_dora=True, **plain)
    if name == "modules-to-save":
        return build_adapter(base_dir, tmp / name, seed=2, modules_to_save=["lm_head"], **plain)
    if name == "bias":
        return build_adapter(base_dir, tmp / name, seed=2, bias="all", **plain)
    if name == "missing-weights":
        path = build_adapter(base_dir, tmp / name, seed=2, **plain)
        _edit_weights(path, drop="layers.1.self_attn.q_proj")
        return path
    if name == "weights-beyond-targets":
        path = build_adapter(base_dir, tmp / name, seed=2, **plain)
        _edit_config(path, target_modules=["v_proj"])
        return path
    if name == "unknown-target":
        path = build_adapter(base_dir, tmp / name, seed=2, **plain)
        _edit_config(path, target_modules=["q_proj", "v_proj", "c_attn"])
        return path
    if name == "stray-tensor":
        path = build_adapter(base_dir, tmp / name, seed=2, **plain)
        _edit_weights(path, add={"base_model.model.model.norm.weight": torch.ones(64)})
        return path
    if name == "not-an-adapter":
        (tmp / name).mkdir()
        return tmp / name
    raise AssertionError(name)


# case -> what the message must say
REFUSALS = {
    "hidden-size": r"hidden_size=32, this model has 64",
    "hidden-size-no-base-hint": r"q_proj\.lora_A has shape \(8, 32\), the base needs \(8, 64\)",
    "model-type": r"model_type='mistral', this model has 'llama'",
    "embed-tokens": r"model\.embed_tokens: LoRA on embeddings or the output head is not supported",
    "lm-head": r"includes lm_head",
    "rank-over-max": r"r=32 exceeds .*max_lora_rank=16",
    "dora": r"DoRA \(use_dora\) is not supported",
    "modules-to-save": r"modules_to_save .*lm_head.* is not supported",
    "bias": r"bias='all' is not supported",
    "missing-weights": r"no LoRA weights for targeted modules model\.layers\.1\.self_attn\.q_proj",
    "weights-beyond-targets": (
        r"LoRA weights for model\.layers\.0\.self_attn\.q_proj.*which target_modules does not name"
    ),
    "unknown-target": r"'c_attn' match none of this llama model's LoRA-capable modules",
    "stray-tensor": r"'base_model\.model\.model\.norm\.weight', which is not a LoRA A/B weight",
    "not-an-adapter": r"no adapter_config\.json",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_mismatch_is_a_value_error_naming_the_difference(
    base_dir: Path, engine: Engine, tmp_path: Path, case: str
) -> None:
    path = _case(case, base_dir, tmp_path)
    with pytest.raises(ValueError, match=REFUSALS[case]) as raised:
        engine.lora.load(case, "local", str(path))
    assert case in str(raised.value)  # the message names the adapter too
    assert case not in engine.lora.registry and case not in engine.lora.registry.host


def test_files_larger_than_any_servable_adapter_are_refused_unread(
    base_dir: Path, engine: Engine, tmp_path: Path
) -> None:
    # peft's adapter of the largest kind this base serves at the slots' rank: every projection.
    largest = build_adapter(base_dir, tmp_path / "largest", seed=3, r=MAX_RANK, lora_alpha=16,
                            target_modules="all-linear")
    assert engine.lora.load("largest", "local", str(largest)).rank == MAX_RANK
    float32_bytes = sum(t.numel() * 4 for t in load_file(str(largest / "adapter_model.safetensors")).values())
    # Files far larger, sparse (they take no disk): read whole, they would take the host's memory.
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "adapter_config.json").write_bytes((largest / "adapter_config.json").read_bytes())
    with open(huge / "adapter_model.safetensors", "wb") as file:
        file.truncate(3 * 2**30)
    with pytest.raises(ValueError, match=r"'huge': adapter_model\.safetensors is 3\.0 GiB, more than any adapter of "
                                         rf"rank up to {MAX_RANK} for this model can be \((\d+\.\d) MiB\)$") as raised:
        engine.lora.load("huge", "local", str(huge))
    limit_mib = float(re.search(r"\((\d+\.\d) MiB\)$", str(raised.value)).group(1))  # type: ignore[union-attr]
    # The float32 bytes of that largest adapter, and a small allowance for the file's header.
    assert float32_bytes / 2**20 - 0.05 <= limit_mib <= float32_bytes / 2**20 + 2
    with open(huge / "adapter_config.json", "wb") as file:
        file.truncate(65 * 2**20)
    with pytest.raises(ValueError, match=r"adapter_config\.json is 65\.0 MiB, more than an adapter's tokenizer, "
                                         r"template or config file may be \(64\.0 MiB\)$"):
        engine.lora.load("huge", "local", str(huge))
    assert "huge" not in engine.lora.registry


def test_missing_adapter_is_not_found(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AdapterNotFoundError, match="does not exist"):
        engine.lora.load("gone", "local", str(tmp_path / "gone"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(AdapterNotFoundError, match="quiver-tests/no-such-adapter"):
        engine.lora.load("quiver-tests/no-such-adapter@v1", "hub", "", "")
    with pytest.raises(ValueError, match="source must be one of hub, local, s3"):
        engine.lora.load("x", "gcs", str(tmp_path), "")
    with pytest.raises(ValueError, match="needs the directory"):
        engine.lora.load("x", "local", "", "")


def test_config_reader_refuses_malformed_files(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_lora_config(tmp_path)
    with pytest.raises(ValueError, match="r must be a positive integer"):
        parse_lora_config({"r": 0, "target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="peft_type PREFIX_TUNING is not supported"):
        parse_lora_config({"peft_type": "PREFIX_TUNING"})
    with pytest.raises(ValueError, match="target_modules is empty"):
        parse_lora_config({"r": 4})
    # Issue 48: nesting deeper than Python's decoder can recurse is a malformed config (400), not a
    # RecursionError (500); a deep value that does parse is quoted short, not repr'd whole.
    depth = 100_000
    (tmp_path / "adapter_config.json").write_text('{"r": 4, "target_modules": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ValueError, match="nested too deeply"):
        read_lora_config(tmp_path)
    deep: list = ["q_proj"]
    for _ in range(depth):
        deep = [deep]
    with pytest.raises(ValueError, match=r"must be a string or a list of strings, got \[+\.\.\.\]+$"):
        parse_lora_config({"r": 4, "target_modules": deep})
    # Values Python cannot use were a re.error or an OverflowError once resolved (500): a 400 now.
    for key, value, says in [("target_modules", "(", "not a regular expression"),
                             ("exclude_modules", "(", "not a regular expression"),
                             ("rank_pattern", {"(": 2}, "not a regular expression"),
                             ("layers_pattern", "(", "not a regular expression"),
                             ("lora_alpha", 10**400, "out of range"),
                             ("alpha_pattern", {"q_proj": 10**400}, "out of range")]:
        with pytest.raises(ValueError, match=f"{key} .*{says}"):
            parse_lora_config({"r": 4, "target_modules": ["q_proj"], "layers_to_transform": [0], key: value})
