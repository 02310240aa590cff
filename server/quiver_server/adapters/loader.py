"""Reads a PEFT LoRA directory into per-projection A/B tensors in the serving dtype.

PEFT saves `adapter_model.safetensors` (older adapters: `adapter_model.bin`) with keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]);
some older ones keep the adapter name (`lora_A.default.weight`). Any other tensor (DoRA
magnitudes, embedding LoRA, biases, trained module copies) is something we would not apply,
so it is an error rather than ignored.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load

from quiver_server.adapters.confined import read_confined

from quiver_server.adapters.peft_config import LoraConfig, read_lora_config, resolve_targets
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.adapters.validation import check_adapter
from quiver_server.batch_types import AdapterInfo

log = logging.getLogger(__name__)

SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])(?:\.[^.]+)?\.weight$")

# (layer, projection) -> (A [r, in], B [out, r])
LoraPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter in host memory, checked against the base and ready to copy into a slot."""

    adapter_id: str
    path: str
    rank: int
    scaling: float
    weights: LoraPairs = field(repr=False)  # in the base's projection order (see load_adapter_dir)

    @property
    def target_modules(self) -> list[str]:
        return list(dict.fromkeys(name for _, name in self.weights))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def info(self) -> AdapterInfo:
        return AdapterInfo(path=self.path, rank=self.rank, scaling=self.scaling, target_modules=self.target_modules)


def read_tensors(adapter_dir: Path, root: Path | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """(file name, tensors on the CPU) of the adapter's weight file, read only if it resolves inside `root`.

    The bytes are parsed from the very file that was checked, never reopened by name.
    """
    root = root or adapter_dir.resolve()
    data = read_confined(adapter_dir, SAFETENSORS_FILE, root)
    if data is not None:
        try:
            return SAFETENSORS_FILE, safetensors_load(data)
        except Exception as error:  # safetensors raises its own error types for corrupt files
            log.warning("cannot parse %s in %s: %s", SAFETENSORS_FILE, adapter_dir, error)
            raise ValueError(f"{SAFETENSORS_FILE} is not a valid safetensors file") from None
    data = read_confined(adapter_dir, BIN_FILE, root)
    if data is not None:
        try:
            # weights_only: a pickle from the internet must not run code.
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:
            log.warning("cannot parse %s in %s: %s", BIN_FILE, adapter_dir, error)
            raise ValueError(f"{BIN_FILE} is not a valid PyTorch weights file") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise ValueError(f"{BIN_FILE} does not hold a dict of tensors")
        return BIN_FILE, tensors
    # No path in the message: clients see it, and server paths are not their business.
    raise ValueError(f"the adapter directory has neither {SAFETENSORS_FILE} nor {BIN_FILE}")


def lora_pairs(file_name: str, tensors: dict[str, torch.Tensor], spec: BaseModelSpec) -> LoraPairs:
    """Groups PEFT's tensors by (layer, projection); refuses tensors we would not apply."""
    modules = spec.module_paths()
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ValueError(
                f"{file_name} holds {key!r}, which is not a LoRA A/B weight of a linear projection "
                "(DoRA, embedding LoRA, biases and modules_to_save are not supported)"
            )
        module = match["module"]
        # Adapters trained on the bare backbone (no causal-LM head) lack the leading "model.".
        where = modules.get(module) or modules.get(f"model.{module}")
        if where is None:
            raise ValueError(
                f"{file_name} has LoRA weights for {module}, which is not a LoRA-capable module of this "
                f"{spec.model_type} model ({' '.join(spec.projections)} in layers 0..{spec.num_layers - 1})"
            )
        halves.setdefault(where, {})[match["half"]] = tensor
    pairs: LoraPairs = {}
    for (layer, name), found in sorted(halves.items()):
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise ValueError(f"{file_name} has no {missing} for {spec.module_path(layer, name)}")
        pairs[(layer, name)] = (found["A"], found["B"])
    return pairs


def load_adapter_dir(
    adapter_id: str,
    adapter_dir: Path,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
    root: Path | None = None,
) -> LoadedAdapter:
    """Reads, checks (ValueError saying what differs from the base) and converts an adapter.

    Every file read must resolve inside `root` (canonical; default: the adapter directory).
    """
    root = root or adapter_dir.resolve()
    config: LoraConfig = read_lora_config(adapter_dir, root)
    targets = resolve_targets(config, spec)
    file_name, tensors = read_tensors(adapter_dir, root)
    pairs = lora_pairs(file_name, tensors, spec)
    check_adapter(config, targets, pairs, spec, max_rank, file_name)

    def host_copy(tensor: torch.Tensor) -> torch.Tensor:
        converted = tensor.to(dtype).contiguous()
        # Pinned pages let activation copy into a slot asynchronously.
        return converted.pin_memory() if pin_memory else converted

    # Ordered by projection as the base lists them, so `target_modules` reads in that order.
    order = {name: index for index, name in enumerate(spec.projections)}
    weights = {
        (layer, name): (host_copy(a), host_copy(b))
        for (layer, name), (a, b) in sorted(pairs.items(), key=lambda item: (order[item[0][1]], item[0][0]))
    }
    return LoadedAdapter(
        adapter_id=adapter_id,
        path=str(adapter_dir),
        rank=config.rank,
        scaling=config.scaling,
        weights=weights,
    )
