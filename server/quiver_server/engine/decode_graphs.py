"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed instead of the
~1,000 kernel launches of an eager 8B decode step.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer sized
for the largest bucket (token ids, positions, KV slots, sequence lengths, block tables, adapter
slots) and the graph of bucket b reads the first b rows of each. A step of n rows copies its
metadata into rows [0, n) and pads rows [n, b) so that they cannot touch a real row:

- length 0: the paged decode kernel reads no key for them and writes zeros;
- their K/V go to the cache's scratch block, which no block table holds;
- adapter slot -1 (no delta), token 0 at position 0; every layer is row-wise but attention,
  which reads each sequence's own blocks only, so a real row's output does not depend on them.

Adapters switch inside a graph by slot index: the LoRA kernels of every projection are captured
(`exercising_every_slot_buffer`), reading the slot buffers, whose untargeted parts hold zeros.
Steps larger than the largest bucket run eagerly. Without CUDA (the tests) the same padded
batches run eagerly, which is what proves the padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels.lora_meta import LoraBatchMeta, RankClasses
from quiver_server.engine.kv_cache import PagedKVCache
from quiver_server.models.family import ModelFamily

# Beyond this many rows a step is big enough that launch overhead stops mattering (vLLM's 512
# is for larger GPUs' batches; the static buffers and graph pool grow with it).
MAX_CAPTURED_BATCH = 256


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to the first that holds max_batch_size (at most
    MAX_CAPTURED_BATCH): a step pads to the next bucket, under 8 rows past 8."""
    limit = min(max_batch_size, MAX_CAPTURED_BATCH)
    candidates = [1, 2, 4, *range(8, MAX_CAPTURED_BATCH + 1, 8)]
    return [size for size in candidates if size < limit] + [next(size for size in candidates if size >= limit)]


class DecodeGraphs:
    def __init__(
        self,
        model: ModelFamily,
        kv_cache: PagedKVCache,
        scratch_block: int,
        max_batch_size: int,
        max_blocks_per_sequence: int,
        block_size: int,
        lora_ranks: RankClasses | None,
        device: torch.device,
    ) -> None:
        """scratch_block: a cache block no request is given (padded rows write their K/V there);
        lora_ranks: the adapter slots' rank classes, None without adapter slots."""
        self.model, self.kv_cache = model, kv_cache
        self.sizes = bucket_sizes(max_batch_size)
        rows, self.block_size = self.sizes[-1], block_size
        long = torch.long
        self.input_ids = torch.zeros(rows, dtype=long, device=device)
        self.positions = torch.zeros(rows, dtype=long, device=device)
        self.seq_lens = torch.zeros(rows, dtype=long, device=device)
        self.slot_mapping = torch.full((rows,), scratch_block * block_size, dtype=long, device=device)
        self.block_tables = torch.full((rows, max_blocks_per_sequence), scratch_block, dtype=long, device=device)
        # Row 0: each row's slot; with several rank classes, row 1 + c: its row in class c.
        self.lora_ranks = lora_ranks
        classes = len(lora_ranks.ranks) if lora_ranks is not None and len(lora_ranks.ranks) > 1 else 0
        self.lora_slots = (torch.full((1 + classes, rows), -1, dtype=torch.int32, device=device)
                           if lora_ranks is not None else None)
        self.scratch_slot = scratch_block * block_size
        # Host staging for the per-step metadata: pinned on a GPU, so its copies are truly
        # asynchronous (from pageable memory the copy waits for the host-side staging).
        pinned = device.type == "cuda"
        self._host_positions = torch.zeros(rows, dtype=long, pin_memory=pinned)
        self._host_slots = torch.zeros(1 + classes, rows, dtype=torch.int32, pin_memory=pinned)
        self.batches = {size: self._batch(size) for size in self.sizes}
        # Each graph copies its logits here: its own output then lives only inside the capture,
        # and the buckets' graphs reuse one pool instead of each keeping [b, vocab] alive.
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def _batch(self, size: int) -> ForwardBatch:
        """The decode batch of bucket `size`: views of the static buffers' first rows."""
        lora = None
        if self.lora_slots is not None and self.lora_ranks is not None:
            lora = LoraBatchMeta.for_class_rows(self.lora_slots[0, :size], self.lora_slots[1:, :size].unbind(0),
                                                self.lora_ranks.ranks)
        return ForwardBatch(
            is_prefill=False,
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            logits_indices=torch.arange(size, device=self.positions.device),
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            kv_span=self.block_tables.shape[1] * self.block_size,
            lora=lora,
        )

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, None beyond the largest (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= rows), None)

    def capture(self, every_part_in_use: Callable[[], AbstractContextManager[None]]) -> tuple[float, int]:
        """Captures every bucket, largest first, into one memory pool; returns (seconds, bytes
        of GPU memory the graphs took)."""
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with every_part_in_use():
            for size in reversed(self.sizes):
                self._reset_padding(0, size)
                warm = self._forward(size)  # compiles and probes the kernels outside the graph
                if self.logits is None:
                    self.logits = torch.empty(self.max_rows, warm.shape[1], dtype=warm.dtype, device=device)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[:size].copy_(self._forward(size))
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        return time.perf_counter() - started, torch.cuda.memory_allocated(device) - before

    def run(self, input_ids: torch.Tensor, lengths: list[int], block_table: torch.Tensor,
            lora_slots: list[int] | None) -> torch.Tensor:
        """The logits [n, vocab] of a decode step of n <= max_rows rows: input_ids [n] on the
        device, lengths (tokens cached per row, the new token's position), block_table [n, nb]
        on the device, lora_slots per row (None: no adapters in the step)."""
        rows = len(lengths)
        size = self.bucket(rows)
        if size is None or block_table.shape[1] > self.block_tables.shape[1]:
            raise ValueError(f"a decode step of {rows} rows and {block_table.shape[1]} blocks each does not fit "
                             f"the captured buckets ({self.max_rows} rows, {self.block_tables.shape[1]} blocks)")
        # The previous step's copies out of the staging buffers are done: its tokens were read back.
        self._host_positions[:rows] = torch.tensor(lengths, dtype=torch.long)
        positions = self._host_positions[:rows].to(self.positions.device, non_blocking=True)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.seq_lens[:rows].copy_(positions + 1)
        self.block_tables[:rows, : block_table.shape[1]].copy_(block_table)
        rows_index = torch.arange(rows, device=positions.device)
        self.slot_mapping[:rows].copy_(
            block_table[rows_index, positions // self.block_size] * self.block_size + positions % self.block_size)
        if self.lora_slots is not None and self.lora_ranks is not None:
            slots = lora_slots if lora_slots is not None else [-1] * rows
            per_class = self.lora_ranks.split(slots) if self.lora_slots.shape[0] > 1 else []
            self._host_slots[:, :rows] = torch.tensor([slots, *per_class], dtype=torch.int32)
            self._host_slots[:, rows:] = -1
            # The whole buffer: a copy of a strided part would stage through pageable memory.
            self.lora_slots.copy_(self._host_slots, non_blocking=True)
        self._reset_padding(rows, size)
        graph = self.graphs.get(size)
        if graph is None or self.logits is None:
            return self._forward(size)[:rows]
        graph.replay()
        # A view of the shared buffer: the step reads it (sampling) before the next replay.
        return self.logits[:rows]

    def _reset_padding(self, rows: int, size: int) -> None:
        """Rows [rows, size): length 0, K/V into the scratch block, no adapter."""
        self.input_ids[rows:size] = 0
        self.positions[rows:size] = 0
        self.seq_lens[rows:size] = 0
        self.slot_mapping[rows:size] = self.scratch_slot
        if self.lora_slots is not None:
            self.lora_slots[:, rows:size] = -1

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.batches[size], self.kv_cache)
