"""Runs the real grpc.aio shard server in a background thread for tests that talk to it.

The server gets its own event loop in a thread so that tests can use grpc's plain blocking client
(no async test plugin needed) exactly as an external process would.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from quiver_server.interceptor import FatalHandler
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.server import start_server
from quiver_server.service import ShardService


@contextmanager
def running_shard(
    service: ShardService, socket_path: Path, on_fatal: FatalHandler | None = None
) -> Iterator[shard_pb2_grpc.ShardStub]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-shard-loop", daemon=True)
    thread.start()
    starting = asyncio.run_coroutine_threadsafe(start_server(service, str(socket_path), on_fatal), loop)
    server = starting.result(30)
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    try:
        yield shard_pb2_grpc.ShardStub(channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        service.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


class BlockPool:
    """Hands out KV block tables the way the router does: disjoint ids, enough for every token."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self._free = list(range(num_blocks))

    def table(self, num_tokens: int) -> list[int]:
        needed = math.ceil(num_tokens / self.block_size)
        if needed > len(self._free):
            raise RuntimeError("test ran out of KV blocks")
        table, self._free = self._free[:needed], self._free[needed:]
        return table


def greedy_request(
    request_id: int, input_ids: list[int], max_new_tokens: int, pool: BlockPool, seed: int = 1
) -> shard_pb2.Request:
    return shard_pb2.Request(
        id=request_id,
        input_ids=input_ids,
        blocks=pool.table(len(input_ids) + max_new_tokens),
        sampling=shard_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, seed=seed),
        max_new_tokens=max_new_tokens,
    )


def generate_greedy(
    stub: shard_pb2_grpc.ShardStub, pool: BlockPool, batch_id: int, adapter_id: str, prompt: list[int],
    new_tokens: int,
) -> list[int]:
    """One request's greedy tokens, prefill then decode steps as the router drives them; its
    batch cleared at the end. `adapter_id` must be active ("" = the base model)."""
    request = greedy_request(1, prompt, new_tokens, pool)
    request.adapter_id = adapter_id
    prefill = stub.Prefill(shard_pb2.PrefillRequest(batch_id=batch_id, requests=[request]))
    tokens = [prefill.generations[0].token_id]
    batch = prefill.batch
    for _ in range(new_tokens - 1):
        decode = stub.Decode(shard_pb2.DecodeRequest(batches=[batch]))
        tokens.append(decode.generations[0].token_id)
        batch = decode.batch
    stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=batch_id))
    return tokens
