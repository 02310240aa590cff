"""Reading a model directory as `transformers.save_pretrained` writes it: config.json,
generation_config.json and safetensors weights (one file, or shards listed in an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

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


def tensor_names(model_dir: Path) -> list[str]:
    """The names of a safetensors checkpoint's tensors, from its files' headers (no tensor is read)."""
    names: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


@dataclass
class ReadTally:
    """Bytes of a checkpoint's tensors, and of what a loader read of them."""

    total: int = 0
    read: int = 0


# safetensors' dtype names -> bytes per element
_ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                  "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


class UnreadTensor:
    """A safetensors tensor not read yet, valid while its file is open (until the next tensor of
    `iter_tensors`): indexing it reads only the rows or columns indexed (a tensor-parallel rank
    reads its share, not the whole tensor); `read` reads all of it. What is read is tallied."""

    def __init__(self, file: Any, name: str, device: torch.device, tally: ReadTally) -> None:
        self._file, self._name, self._device, self._tally = file, name, device, tally
        self._slice = file.get_slice(name)
        tally.total += self.shape.numel() * _ELEMENT_BYTES.get(self._slice.get_dtype(), 0)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._tallied(self._slice[index].to(self._device))

    def read(self) -> torch.Tensor:
        return self._tallied(self._file.get_tensor(self._name))

    def _tallied(self, tensor: torch.Tensor) -> torch.Tensor:
        self._tally.read += tensor.nbytes
        return tensor


CheckpointTensor = torch.Tensor | UnreadTensor | QuantizedWeight


def read_whole(tensor: torch.Tensor | UnreadTensor) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, UnreadTensor) else tensor


@overload
def iter_tensors(model_dir: Path, device: torch.device,
                 unread_into: None = None) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]: ...


@overload
def iter_tensors(model_dir: Path, device: torch.device,
                 unread_into: ReadTally) -> Iterator[tuple[str, CheckpointTensor]]: ...


def iter_tensors(model_dir: Path, device: torch.device,
                 unread_into: ReadTally | None = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, tensor) for every checkpoint tensor, one at a time, loaded onto `device`; a GGUF
    companion directory's come from its file, quantized projections as `QuantizedWeight`s (on
    the CPU: packing for the device happens at load's end). With a tally (`unread_into`),
    safetensors tensors come as `UnreadTensor`s, for the loader to read what it keeps."""
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
                yield name, f.get_tensor(name) if unread_into is None else UnreadTensor(f, name, device, unread_into)


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
