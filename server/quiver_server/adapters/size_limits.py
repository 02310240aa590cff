"""How large an adapter's files may be, checked before they are read or downloaded.

A weight file can hold no more than the largest adapter this base serves at the slots' rank: every
LoRA-capable projection targeted, A [r, in] and B [out, r] per expert, in float32, plus room for
the file's own header. Anything bigger could not be served anyway, and reading it first would
spend the host's memory (or the network) on a client's say-so. Every other file of an adapter
(tokenizer, template, config) is capped at 64 MiB: the tokenizer of a 256k vocabulary is ~35 MB.
Local, hub and object-store adapters share these limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from quiver_server.adapters.spec import BaseModelSpec

MIB = 2**20
OTHER_FILE_MAX_BYTES = 64 * MIB
FLOAT32_BYTES = 4
# A safetensors header is one JSON entry per tensor (name, dtype, shape, offsets: ~150 bytes) and
# its alignment; a PyTorch zip is a record per tensor (headers, name, padding to 64 bytes).
HEADER_BYTES_PER_TENSOR = 1024
HEADER_BYTES = MIB
# PEFT's weight files: adapter_model.safetensors, adapter_model.bin.
WEIGHT_FILE_STEM = "adapter_model."


def human_bytes(size: int) -> str:
    """512 B, 1.2 MiB, 9.1 GiB."""
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


@dataclass(frozen=True)
class SizeLimit:
    max_bytes: int
    reason: str  # completes "<file> is <size>, <reason> (<limit>)"

    def check(self, name: str, size: int) -> None:
        """ValueError naming the file and the limit (never a path: clients see it)."""
        if size > self.max_bytes:
            raise ValueError(f"{name} is {human_bytes(size)}, {self.reason} ({human_bytes(self.max_bytes)})")


OTHER_FILES = SizeLimit(OTHER_FILE_MAX_BYTES, "more than an adapter's tokenizer, template or config file may be")


@dataclass(frozen=True)
class AdapterSizeLimits:
    weights: SizeLimit
    other: SizeLimit = OTHER_FILES

    @classmethod
    def of(cls, spec: BaseModelSpec, max_rank: int) -> AdapterSizeLimits:
        """The limits for adapters of rank up to `max_rank` (the slots' capacity) on `spec`'s base."""
        weights = tensors = 0
        for _, name in spec.present:
            projection = spec.projections[name]
            weights += projection.experts * max_rank * (projection.in_features + projection.out_features)
            tensors += 2 * projection.experts  # an older adapter may keep one A/B pair per expert
        max_bytes = weights * FLOAT32_BYTES + tensors * HEADER_BYTES_PER_TENSOR + HEADER_BYTES
        return cls(SizeLimit(max_bytes, f"more than any adapter of rank up to {max_rank} for this model can be"))

    def for_file(self, name: str) -> SizeLimit:
        return self.weights if name.startswith(WEIGHT_FILE_STEM) else self.other
