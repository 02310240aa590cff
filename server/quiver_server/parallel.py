"""Tensor parallelism: this shard's place among the ranks that split one model, and the two
collectives a split model needs.

Megatron's split (docs/architecture.md#tensor-parallelism): q/k/v and gate/up are split by output
column (each rank its own heads and its slice of the MLP), o and down by input column, their
partial outputs summed by one all-reduce each; the embedding and the LM head are split by
vocabulary row, the embedding's rows summed by an all-reduce, the logits gathered. Every rank
then holds the whole logits and samples the same tokens (the sampler's streams are seeded per
request), so the router may read any one rank's answer.

The group is torch.distributed's default one, set up from the launcher's environment
(MASTER_ADDR, MASTER_PORT): gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of {self.size} ranks")

    def span(self, total: int, what: str) -> slice:
        """This rank's equal share of `total` items (heads, columns); refused where they do not
        split evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) do not split over {self.size} shards: "
                             f"--num-shard must divide it")
        share = total // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def padded_span(self, total: int) -> slice:
        """This rank's share of `total` rows in equal parts of ceil(total / size), the last one
        padded (its rows past `total` are the caller's to fill)."""
        share = -(-total // self.size)
        return slice(self.rank * share, (self.rank + 1) * share)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x's elementwise maximum over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, c] on every rank -> [rows, size * c], rank r's columns at r * c."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

# The rows of a tensor a rank holds: one span, or several side by side (a fused projection whose
# parts each split: Phi-3's q|k|v).
RowSpans = tuple[slice, ...]


class Sliceable(Protocol):
    """A tensor, or a checkpoint tensor that indexing reads (`weights.UnreadTensor`)."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def take_rows(tensor: Sliceable, spans: RowSpans, dim: int = 0) -> torch.Tensor:
    """`tensor`'s `spans` along `dim`, in order (a view when there is one span)."""
    index: tuple[Any, ...] = (slice(None),) * dim if dim >= 0 else (Ellipsis,)
    tail: tuple[Any, ...] = () if dim >= 0 else (slice(None),) * (-dim - 1)
    parts = [tensor[index + (span,) + tail] for span in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def join_group(rank: int, size: int, device: torch.device) -> TensorParallel:
    """Joins the launcher's process group (env://: MASTER_ADDR and MASTER_PORT) as `rank` of
    `size`; SINGLE when there is one rank."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":
        take_cpu_share(rank, size)
    elif device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size)
    log.info("rank %d of %d joined the %s group", rank, size, backend)
    return TensorParallel(rank, size)


def take_cpu_share(rank: int, size: int) -> list[int]:
    """Pins this process to its share of the CPUs it may run on (contiguous, so a rank's cores
    sit together: on a two-socket host with one rank per socket, one NUMA node each) and sizes
    torch's thread pool to them (unless OMP_NUM_THREADS says otherwise): ranks that each
    spread over every core would take turns on them. With fewer CPUs than ranks, ranks share."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // size)
    first = min(rank * share, len(cpus) - share)
    mine = cpus[first : first + share]
    os.sched_setaffinity(0, mine)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(mine))
    log.info("rank %d runs on CPUs %s", rank, ",".join(map(str, mine)))
    return mine
