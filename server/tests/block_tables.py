"""Block tables for engine tests, handed out as the router does."""

from __future__ import annotations

from quiver_server.engine.kv_cache import BLOCK_SIZE


class Blocks:
    """Disjoint block tables, as the router hands them out."""

    def __init__(self) -> None:
        self.next = 0

    def table(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        self.next += count
        return list(range(self.next - count, self.next))
