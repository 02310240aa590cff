"""cached_tokens and prefill_until over real gRPC: a chunk-only Prefill answers no generation
and an empty batch, the last chunk and a prefix-cache hit answer transformers' tokens and
logprobs, and a bad span is INVALID_ARGUMENT while the shard keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from shard_harness import BlockPool, greedy_request, running_shard
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM

from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

NEW_TOKENS = 4
PROMPT = [(11 * i + 5) % 300 for i in range(35)]


@dataclass
class Shard:
    stub: shard_pb2_grpc.ShardStub
    pool: BlockPool
    reference: torch.nn.Module


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=5)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(str(model_dir), "tiny-llama", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    socket_path = Path(tmp_path_factory.mktemp("sock")) / "shard.sock"
    with running_shard(ShardService(engine), socket_path) as stub:
        warm = stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=64,
                                                   max_batch_size=4))
        yield Shard(stub, BlockPool(warm.block_size, warm.num_blocks), reference)


def _reference(model: torch.nn.Module, prompt: list[int]) -> list[tuple[int, float]]:
    """transformers' greedy tokens and their raw logprobs, by a full forward pass per token."""
    sequence, out = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logprobs = torch.log_softmax(model(torch.tensor([sequence])).logits[0, -1], dim=-1)
            token = int(logprobs.argmax())
            out.append((token, float(logprobs[token])))
            sequence.append(token)
    return out


def test_chunks_then_a_prefix_hit_over_grpc(shard: Shard) -> None:
    stub = shard.stub
    chunked = greedy_request(1, PROMPT, NEW_TOKENS, shard.pool)
    chunked.prefill_until = 20
    only_chunk = stub.Prefill(shard_pb2.PrefillRequest(batch_id=1, requests=[chunked]))
    assert list(only_chunk.generations) == []
    assert (only_chunk.batch.id, list(only_chunk.batch.request_ids)) == (1, [])

    chunked.cached_tokens, chunked.prefill_until = 20, 0
    # A second request reuses the first block the chunk wrote (a prefix-cache hit).
    hit = greedy_request(2, PROMPT, NEW_TOKENS, shard.pool)
    hit.blocks[0] = chunked.blocks[0]
    hit.cached_tokens = shard.pool.block_size
    last = stub.Prefill(shard_pb2.PrefillRequest(batch_id=2, requests=[chunked, hit]))
    assert list(last.batch.request_ids) == [1, 2]
    got: dict[int, list[tuple[int, float]]] = {g.request_id: [(g.token_id, g.logprob)] for g in last.generations}
    batch = last.batch
    for _ in range(NEW_TOKENS - 1):
        decode = stub.Decode(shard_pb2.DecodeRequest(batches=[batch]))
        batch = decode.batch
        for g in decode.generations:
            got[g.request_id].append((g.token_id, g.logprob))
    stub.ClearCache(shard_pb2.ClearCacheRequest())
    expected = _reference(shard.reference, PROMPT)
    for rid in (1, 2):
        assert [t for t, _ in got[rid]] == [t for t, _ in expected], rid
        assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def test_bad_span_is_invalid_argument(shard: Shard) -> None:
    stub = shard.stub
    whole = greedy_request(3, PROMPT, NEW_TOKENS, shard.pool)
    whole.cached_tokens = len(PROMPT)
    with_logprobs = greedy_request(4, PROMPT, NEW_TOKENS, shard.pool)
    with_logprobs.cached_tokens, with_logprobs.prompt_logprobs = 16, 1
    for bad, says in ((whole, "must be less than the prompt"), (with_logprobs, "prompt_logprobs need")):
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefill(shard_pb2.PrefillRequest(batch_id=3, requests=[bad]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in (raised.value.details() or "")
    fine = stub.Prefill(shard_pb2.PrefillRequest(batch_id=3, requests=[greedy_request(5, PROMPT, 1, shard.pool)]))
    assert [g.token_id for g in fine.generations] == [_reference(shard.reference, PROMPT)[0][0]]
    stub.ClearCache(shard_pb2.ClearCacheRequest())
