"""Reading a model directory as `transformers.save_pretrained` writes it: config.json,
generation_config.json and safetensors weights (one file, or shards listed in an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from quiver_server.quant.weights import QuantizedWeight

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    with path.open() as f:
        return json.load(f)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files in load order. Only the transformers layout is read (other files such as
    Mistral's `consolidated.safetensors` use different tensor names and are ignored)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def iter_tensors(model_dir: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(name, tensor) for every checkpoint tensor, one at a time, loaded onto `device`; a GGUF
    companion directory's come from its file, quantized projections as `QuantizedWeight`s (on
    the CPU: packing for the device happens at load's end)."""
    from quiver_server.gguf_source import source_of

    gguf = source_of(model_dir)
    if gguf is not None:
        from quiver_server.quant.gguf_model import iter_gguf_tensors

        for name, tensor in iter_gguf_tensors(gguf):
            yield name, tensor if isinstance(tensor, QuantizedWeight) else tensor.to(device)
        return
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    """generation_config.json's eos_token_id if it has one, else config.json's (int or list)."""
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        with path.open() as f:
            generation = json.load(f)
        if generation.get("eos_token_id") is not None:
            return _as_id_list(generation["eos_token_id"])
    return _as_id_list(config.get("eos_token_id"))


def config_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The checkpoint's dtype (`dtype` in transformers 5, `torch_dtype` before), if stated."""
    name = config.get("dtype") or config.get("torch_dtype")
    if not name:
        return None
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else None
