"""Reads a PEFT LoRA directory into per-projection A/B tensors in the serving dtype.

PEFT saves `adapter_model.safetensors` (older adapters: `adapter_model.bin`) with keys like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]);
some older ones keep the adapter name (`lora_A.default.weight`); `peft_keys` maps them (and a
sparse MLP's expert keys) to our projections. Any other tensor (DoRA magnitudes, embedding
LoRA, biases, trained module copies) is something we would not apply, so it is an error rather
than ignored.

A module whose scaling differs from the adapter's (`rank_pattern`, `alpha_pattern`) has the
ratio folded into its B here, so the slots keep one scaling per adapter.
"""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load

from quiver_server.adapters.confined import read_confined
from quiver_server.adapters.peft_config import LoraConfig, read_lora_config, resolve_targets
from quiver_server.adapters.peft_keys import lora_weights
from quiver_server.adapters.size_limits import AdapterSizeLimits, SizeLimit
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.adapters.validation import check_adapter
from quiver_server.engine.batch_types import AdapterInfo

log = logging.getLogger(__name__)

SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# (layer, projection) -> (A [r, in], B [out, r]), or per expert (A [E, r, in], B [E, out, r])
LoraPairs = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter in host memory, checked against the base and ready to copy into a slot."""

    adapter_id: str
    path: str
    rank: int  # the largest of its projections' ranks
    scaling: float
    weights: LoraPairs = field(repr=False)  # in the base's projection order (see load_adapter_dir)
    # What the weights were when read (`weights_digest`): a copy read again from disk after the
    # host cache dropped it must be the same adapter, not files changed in place meanwhile.
    digest: str = ""

    @property
    def target_modules(self) -> list[str]:
        return list(dict.fromkeys(name for _, name in self.weights))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def info(self) -> AdapterInfo:
        return AdapterInfo(path=self.path, rank=self.rank, scaling=self.scaling, target_modules=self.target_modules)


def read_tensors(
    adapter_dir: Path, root: Path | None = None, limit: SizeLimit | None = None
) -> tuple[str, dict[str, torch.Tensor]]:
    """(file name, tensors on the CPU) of the adapter's weight file, read only if it resolves inside `root`
    and is no larger than `limit`.

    The bytes are parsed from the very file that was checked, never reopened by name.
    """
    root = root or adapter_dir.resolve()
    data = read_confined(adapter_dir, SAFETENSORS_FILE, root, limit)
    if data is not None:
        try:
            return SAFETENSORS_FILE, safetensors_load(data)
        except Exception as error:  # safetensors raises its own error types for corrupt files
            log.warning("cannot parse %s in %s: %s", SAFETENSORS_FILE, adapter_dir, error)
            raise ValueError(f"{SAFETENSORS_FILE} is not a valid safetensors file") from None
    data = read_confined(adapter_dir, BIN_FILE, root, limit)
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


def load_adapter_dir(
    adapter_id: str,
    adapter_dir: Path,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
    root: Path | None = None,
    hint_root: Path | None = None,
) -> LoadedAdapter:
    """Reads, checks (ValueError saying what differs from the base) and converts an adapter.

    Every file read must resolve inside `root` (canonical; default: the adapter directory), and the
    weight file be no larger than an adapter of rank up to `max_rank` for `spec`'s base can be.
    `hint_root`: the canonical adapter root (None: none configured), the only place a refusal may
    read the config of the base the adapter names (`validation._base_config_hint`).
    """
    root = root or adapter_dir.resolve()
    config: LoraConfig = read_lora_config(adapter_dir, root)
    targets = resolve_targets(config, spec)
    file_name, tensors = read_tensors(adapter_dir, root, AdapterSizeLimits.of(spec, max_rank).weights)
    found = lora_weights(file_name, tensors, spec, config)
    check_adapter(config, targets, found, spec, max_rank, file_name, hint_root)

    def host_copy(tensor: torch.Tensor) -> torch.Tensor:
        converted = tensor.to(dtype).contiguous()
        # Pinned pages let activation copy into a slot asynchronously.
        return converted.pin_memory() if pin_memory else converted

    # Ordered by projection as the base lists them, so `target_modules` reads in that order.
    order = {name: index for index, name in enumerate(spec.projections)}
    weights = {}
    for (layer, name), weight in sorted(found.items(), key=lambda item: (order[item[0][1]], item[0][0])):
        b = weight.b
        if weight.scaling != config.scaling:
            b = b.float() * (weight.scaling / config.scaling)
        weights[(layer, name)] = (host_copy(weight.a), host_copy(b))
    return LoadedAdapter(
        adapter_id=adapter_id,
        path=str(adapter_dir),
        rank=max(weight.rank for weight in found.values()),
        scaling=config.scaling,
        weights=weights,
        digest=weights_digest(weights, config.scaling),
    )


def weights_digest(weights: LoraPairs, scaling: float) -> str:
    """SHA-256 of the served weights (projections, shapes, dtypes, bytes) and the scaling."""
    digest = hashlib.sha256(repr(scaling).encode())
    for (layer, name), pair in weights.items():
        for tensor in pair:
            digest.update(f"{layer}.{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
