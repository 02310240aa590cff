"""The refusal's "made for another model" hint reads nothing outside the adapter root.

adapter_config.json's `base_model_name_or_path` is the adapter's say-so: read anywhere, it let a
client's adapter probe any directory on the server for a config.json and see its shape keys in
the refusal. The hint is read only from an absolute directory that resolves inside
--adapter-root, from a config.json of at most 1 MiB; otherwise the weights' shapes alone tell."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_adapters import build_adapter
from tiny_models import build_tiny_model

from quiver_server.adapters.registry import AdapterRegistry
from quiver_server.engine.engine import Engine

MAX_RANK = 16
HINT = "hidden_size=32, this model has 64"
SHAPES = r"q_proj\.lora_A has shape \(8, 32\), the base needs \(8, 64\)"
QV = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("root")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, root: Path) -> Engine:
    base_dir = build_tiny_model(tmp_path_factory.mktemp("base"), "llama", seed=5)
    engine = Engine(str(base_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01,
                    adapter_root=str(root))
    engine.warmup(64, 64, 4, max_active_adapters=1, max_lora_rank=MAX_RANK)
    return engine


@pytest.fixture(scope="module")
def narrow_inside(root: Path) -> Path:
    """A model half as wide as the served one, inside the adapter root."""
    return build_tiny_model(root / "bases" / "narrow-32", "llama", seed=9, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def narrow_outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same narrow model outside the root: a directory no adapter may probe."""
    return build_tiny_model(tmp_path_factory.mktemp("outside") / "narrow-32", "llama", seed=9,
                            hidden_size=32, intermediate_size=64)


def _adapter(narrow: Path, directory: Path, base_model_name_or_path: str) -> Path:
    """An adapter made for `narrow` whose adapter_config.json names `base_model_name_or_path`."""
    build_adapter(narrow, directory, seed=2, **QV)
    config_path = directory / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model_name_or_path
    config_path.write_text(json.dumps(config))
    return directory


def _refusal(engine: Engine, adapter_id: str, directory: Path) -> str:
    with pytest.raises(ValueError, match=SHAPES) as raised:  # the weights' shapes tell in every case
        engine.lora.load(adapter_id, "local", str(directory))
    return str(raised.value)


def test_base_inside_the_root_gives_the_hint(engine: Engine, root: Path, narrow_inside: Path) -> None:
    adapter = _adapter(narrow_inside, root / "inside", str(narrow_inside))
    assert HINT in _refusal(engine, "inside", adapter)


# adapter id -> the base its adapter_config.json names (given the root and the outside base)
OUTSIDE: dict[str, Callable[[Path, Path], str]] = {
    "absolute-outside": lambda root, outside: str(outside),
    "dotdot-outside": lambda root, outside: f"{root}/../{outside.parent.name}/{outside.name}",
    "symlink-out": lambda root, outside: str(root / "bases" / "link-out"),
    # Relative names (hub ids) would be resolved against the shard's working directory.
    "relative": lambda root, outside: "bases/narrow-32",
    "home": lambda root, outside: "~/narrow-32",
}


@pytest.mark.parametrize("adapter_id", list(OUTSIDE))
def test_base_outside_the_root_is_not_read(
    engine: Engine, root: Path, narrow_inside: Path, narrow_outside: Path, monkeypatch: pytest.MonkeyPatch,
    adapter_id: str,
) -> None:
    link = root / "bases" / "link-out"
    if not link.is_symlink():
        link.symlink_to(narrow_outside, target_is_directory=True)
    monkeypatch.chdir(root)  # where the relative name would find the base inside the root
    monkeypatch.setenv("HOME", str(narrow_outside.parent))  # where "~" would find the outside one
    adapter = _adapter(narrow_outside, root / adapter_id, OUTSIDE[adapter_id](root, narrow_outside))
    message = _refusal(engine, adapter_id, adapter)
    assert "hidden_size" not in message, message


def test_a_config_over_1_mib_is_not_read(engine: Engine, root: Path, narrow_inside: Path) -> None:
    big = root / "bases" / "big-config"
    shutil.copytree(narrow_inside, big)
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(config) + " " * 2**20)
    message = _refusal(engine, "big-config", _adapter(narrow_inside, root / "big-config", str(big)))
    assert "hidden_size" not in message, message


def test_no_hint_without_an_adapter_root(engine: Engine, tmp_path: Path, narrow_outside: Path) -> None:
    # Without --adapter-root nothing marks where the operator's own models are: no hint at all.
    registry = AdapterRegistry(engine.lora.spec, torch.float32, torch.device("cpu"), max_cpu_adapters=4)
    registry.max_rank = MAX_RANK
    adapter = _adapter(narrow_outside, tmp_path / "a", str(narrow_outside))
    with pytest.raises(ValueError, match=SHAPES) as raised:
        registry.load("a", "local", str(adapter), "")
    assert "hidden_size" not in str(raised.value)
