"""An adapter's files are read only where the operator put them: inside the adapter root.

Real files and real symlinks on disk; the reference is where each link really leads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quiver_server.adapters.confined import OutsideRootError, hub_cache_repo, read_confined
from quiver_server.adapters.loader import read_tensors
from quiver_server.adapters.peft_config import read_lora_config

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def _adapter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(CONFIG))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: torch.zeros(4, 8)}, str(directory / "adapter_model.safetensors"))
    return directory


def _links_to(target: Path, directory: Path) -> Path:
    directory.mkdir(parents=True)
    for file in target.iterdir():
        (directory / file.name).symlink_to(file)
    return directory


def test_an_adapter_made_of_links_out_of_the_root_is_refused(tmp_path: Path) -> None:
    outside = _adapter(tmp_path / "outside")
    root = tmp_path / "root"
    linked = _links_to(outside, root / "linked")
    with pytest.raises(OutsideRootError, match="^adapter_config.json leads outside the adapter root$"):
        read_lora_config(linked, root.resolve())
    with pytest.raises(OutsideRootError, match="^adapter_model.safetensors leads outside the adapter root$"):
        read_tensors(linked, root.resolve())


def test_links_that_stay_inside_the_root_are_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    real = _adapter(root / "real")
    linked = _links_to(real, root / "linked")
    assert read_lora_config(linked, root.resolve()).rank == 4
    name, tensors = read_tensors(linked, root.resolve())
    assert name == "adapter_model.safetensors" and len(tensors) == 1
    # Confined to its own directory (no root given), the same links lead out of it.
    with pytest.raises(OutsideRootError):
        read_lora_config(linked)


def test_a_hub_snapshot_reads_its_blobs(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "1234").write_text(json.dumps(CONFIG))
    (snapshot / "adapter_config.json").symlink_to("../../blobs/1234")
    assert hub_cache_repo(snapshot.resolve()) == repo.resolve()
    assert read_lora_config(snapshot, repo.resolve()).rank == 4
    assert hub_cache_repo(tmp_path) is None


def test_messages_have_no_paths_or_positions(tmp_path: Path) -> None:
    root = tmp_path / "root"
    adapter = root / "a"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{\n\n  "r": 4,\n  oops')
    with pytest.raises(ValueError) as raised:
        read_lora_config(adapter, root.resolve())
    assert str(raised.value) == "adapter_config.json is not valid JSON"
    (adapter / "adapter_config.json").write_text(json.dumps(CONFIG))
    (adapter / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    with pytest.raises(ValueError) as raised:
        read_tensors(adapter, root.resolve())
    assert str(raised.value) == "adapter_model.safetensors is not a valid safetensors file"


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "adapter_config.json")
    with pytest.raises(ValueError, match="is not a regular file"):
        read_confined(tmp_path, "adapter_config.json", tmp_path.resolve())
    assert read_confined(tmp_path, "missing.json", tmp_path.resolve()) is None
