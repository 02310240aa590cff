"""The paged KV cache: fixed-size blocks of token slots whose allocation the router owns.

Per layer, K and V are tensors of shape [num_blocks, block_size, num_kv_heads, head_dim]. A
request's token at position p lives in block `blocks[p // block_size]`, offset
`p % block_size`, where `blocks` is the block table the router handed over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE

    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: decode attention reads (masked) slots that were never written, and
        # a NaN there would leak through the zero attention weight (0 * NaN = NaN).
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]
