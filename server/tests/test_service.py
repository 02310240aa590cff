"""The shard over real gRPC on a unix socket: parity with transformers, error statuses."""

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

from quiver_server.engine.batch_types import ModelInfo
from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

# The correctness rule of DESIGN.md: a greedy divergence is accepted only where the reference's
# two best logits are this close.
TIE_TOLERANCE = 1e-4
NEW_TOKENS = 6


@dataclass
class Reference:
    """transformers' greedy continuation of one prompt, with the logits behind each choice."""

    tokens: list[int]
    logits: list[torch.Tensor]


@dataclass
class Shard:
    stub: shard_pb2_grpc.ShardStub
    model_dir: Path
    pool: BlockPool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(directory, "llama")
    return directory


@pytest.fixture(scope="module")
def reference_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def shard(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    engine = Engine(str(model_dir), "tiny-llama", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    socket_path = tmp_path_factory.mktemp("sock") / "shard.sock"
    with running_shard(ShardService(engine), socket_path) as stub:
        warm = stub.Warmup(
            shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=64, max_batch_size=4)
        )
        assert warm.block_size > 0 and warm.num_blocks > 0
        yield Shard(stub, model_dir, BlockPool(warm.block_size, warm.num_blocks))


def reference_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Reference:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return Reference(out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits])


def assert_matches_reference(got: list[int], logprobs: list[float], ref: Reference) -> None:
    """Token-for-token equality, except after a position where the reference itself is a tie."""
    assert len(got) == len(ref.tokens)
    for position, (token, logprob, want, logits) in enumerate(zip(got, logprobs, ref.tokens, ref.logits, strict=True)):
        if token != want:
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) < TIE_TOLERANCE, f"diverged at {position}: {got} vs {ref.tokens}"
            return
        expected_logprob = float(torch.log_softmax(logits.float(), dim=-1)[want])
        assert logprob == pytest.approx(expected_logprob, abs=1e-3)


def expect_status(code: grpc.StatusCode, call, request) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        call(request)
    assert raised.value.code() == code, raised.value.details()
    assert raised.value.details(), "the status must carry a message for the router to show"
    return raised.value.details()


def test_info_and_health(shard: Shard, reference_model: torch.nn.Module) -> None:
    info = shard.stub.Info(shard_pb2.InfoRequest())
    config = reference_model.config
    assert info.model_id == "tiny-llama"
    assert info.model_type == "llama"
    assert info.vocab_size == config.vocab_size
    assert info.max_position_embeddings == config.max_position_embeddings
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.rank, info.world_size) == (0, 1)
    assert Path(info.model_path).resolve() == shard.model_dir.resolve()
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    assert set(info.eos_token_ids) >= {e for e in eos if e is not None}
    shard.stub.Health(shard_pb2.HealthRequest())


def test_greedy_over_grpc_equals_transformers(shard: Shard, reference_model: torch.nn.Module) -> None:
    """Two prompts prefilled as separate batches, merged by Decode, one filtered out midway."""
    vocab = reference_model.config.vocab_size
    prompts = {11: [(7 * i + 3) % vocab for i in range(5)], 12: [(13 * i + 1) % vocab for i in range(9)]}
    references = {rid: reference_greedy(reference_model, p, NEW_TOKENS) for rid, p in prompts.items()}
    tokens: dict[int, list[int]] = {rid: [] for rid in prompts}
    logprobs: dict[int, list[float]] = {rid: [] for rid in prompts}

    def record(generations) -> None:
        for g in generations:
            tokens[g.request_id].append(g.token_id)
            logprobs[g.request_id].append(g.logprob)

    for batch_id, rid in ((101, 11), (102, 12)):
        prefill = shard.stub.Prefill(
            shard_pb2.PrefillRequest(
                batch_id=batch_id, requests=[greedy_request(rid, prompts[rid], NEW_TOKENS, shard.pool)]
            )
        )
        assert prefill.batch.id == batch_id and list(prefill.batch.request_ids) == [rid]
        record(prefill.generations)

    batches = [
        shard_pb2.CachedBatch(id=101, request_ids=[11]),
        shard_pb2.CachedBatch(id=102, request_ids=[12]),
    ]
    for _ in range(2):
        decode = shard.stub.Decode(shard_pb2.DecodeRequest(batches=batches))
        assert decode.batch.id == 101 and sorted(decode.batch.request_ids) == [11, 12]
        batches = [decode.batch]
        record(decode.generations)

    # Request 11 "finishes" early (as on a stop string); 12 must continue unaffected.
    filtered = shard.stub.FilterBatch(shard_pb2.FilterBatchRequest(batch_id=101, request_ids=[12]))
    assert filtered.batch.id == 101 and list(filtered.batch.request_ids) == [12]
    batches = [filtered.batch]
    while len(tokens[12]) < NEW_TOKENS:
        decode = shard.stub.Decode(shard_pb2.DecodeRequest(batches=batches))
        assert [g.request_id for g in decode.generations] == [12]
        batches = [decode.batch]
        record(decode.generations)

    shard.stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=101))
    first_three = Reference(references[11].tokens[:3], references[11].logits[:3])
    assert_matches_reference(tokens[11], logprobs[11], first_three)
    assert_matches_reference(tokens[12], logprobs[12], references[12])
    # The cleared batch is gone: the shard says so instead of failing inside.
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        shard.stub.Decode,
        shard_pb2.DecodeRequest(batches=[shard_pb2.CachedBatch(id=101, request_ids=[12])]),
    )


def test_a_decode_carrying_a_prefill_over_grpc_equals_transformers(
    shard: Shard, reference_model: torch.nn.Module
) -> None:
    """A Decode of request 21 carries the Prefill of 22: 22's first token comes in the
    response's `prefill`, 22 joins the decoded batch, and both continue as transformers does."""
    vocab = reference_model.config.vocab_size
    prompts = {21: [(5 * i + 2) % vocab for i in range(7)], 22: [(11 * i + 4) % vocab for i in range(10)]}
    references = {rid: reference_greedy(reference_model, p, NEW_TOKENS) for rid, p in prompts.items()}
    tokens: dict[int, list[int]] = {rid: [] for rid in prompts}
    logprobs: dict[int, list[float]] = {rid: [] for rid in prompts}

    def record(generations) -> None:
        for g in generations:
            tokens[g.request_id].append(g.token_id)
            logprobs[g.request_id].append(g.logprob)

    first = shard.stub.Prefill(shard_pb2.PrefillRequest(
        batch_id=301, requests=[greedy_request(21, prompts[21], NEW_TOKENS, shard.pool)]))
    record(first.generations)
    mixed = shard.stub.Decode(shard_pb2.DecodeRequest(
        batches=[first.batch],
        prefill=shard_pb2.PrefillRequest(batch_id=302,
                                         requests=[greedy_request(22, prompts[22], NEW_TOKENS, shard.pool)])))
    assert mixed.HasField("prefill")
    assert [g.request_id for g in mixed.generations] == [21]
    assert [g.request_id for g in mixed.prefill.generations] == [22]
    assert (mixed.prefill.batch.id, list(mixed.prefill.batch.request_ids)) == (302, [22])
    assert (mixed.batch.id, list(mixed.batch.request_ids)) == (301, [21, 22])
    record(mixed.generations)
    record(mixed.prefill.generations)
    batches = [mixed.batch]
    while len(tokens[22]) < NEW_TOKENS:
        decode = shard.stub.Decode(shard_pb2.DecodeRequest(batches=batches))
        assert not decode.HasField("prefill")
        batches = [decode.batch]
        record(decode.generations)
    shard.stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=301))
    assert_matches_reference(tokens[22], logprobs[22], references[22])
    # 21 decoded once more per step than 22 from the mixed step on: its first NEW_TOKENS are compared.
    assert_matches_reference(tokens[21][:NEW_TOKENS], logprobs[21][:NEW_TOKENS], references[21])
    # The prefill's batch id was consumed: no batch of it is kept.
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, shard.stub.Decode,
                  shard_pb2.DecodeRequest(batches=[shard_pb2.CachedBatch(id=302, request_ids=[22])]))


def test_bad_requests_are_invalid_argument_and_shard_keeps_serving(
    shard: Shard, reference_model: torch.nn.Module
) -> None:
    vocab = reference_model.config.vocab_size
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]

    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        shard.stub.Decode,
        shard_pb2.DecodeRequest(batches=[shard_pb2.CachedBatch(id=9999, request_ids=[1])]),
    )
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        shard.stub.FilterBatch,
        shard_pb2.FilterBatchRequest(batch_id=9999, request_ids=[1]),
    )
    # A prompt one block cannot hold, sent with a one-block table.
    long_prompt = [(5 * i + 2) % vocab for i in range(shard.pool.block_size + 3)]
    too_short = greedy_request(21, long_prompt, NEW_TOKENS, shard.pool)
    del too_short.blocks[1:]
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        shard.stub.Prefill,
        shard_pb2.PrefillRequest(batch_id=201, requests=[too_short]),
    )
    out_of_vocab = greedy_request(22, [1, vocab + 5, 2], NEW_TOKENS, shard.pool)
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        shard.stub.Prefill,
        shard_pb2.PrefillRequest(batch_id=202, requests=[out_of_vocab]),
    )

    # Still serving, and still correct.
    shard.stub.Health(shard_pb2.HealthRequest())
    good = shard.stub.Prefill(
        shard_pb2.PrefillRequest(batch_id=203, requests=[greedy_request(23, prompt, 1, shard.pool)])
    )
    assert [g.token_id for g in good.generations] == reference_greedy(reference_model, prompt, 1).tokens
    shard.stub.ClearCache(shard_pb2.ClearCacheRequest())


class _BrokenEngine:
    """Stands in for an engine whose forward pass fails for reasons other than a bad request."""

    info = ModelInfo(
        model_id="broken", model_type="llama", dtype="float32", device="cpu", vocab_size=8,
        max_position_embeddings=8, eos_token_ids=[0], model_path="/nonexistent",
    )

    def prefill(self, batch_id, requests):
        raise RuntimeError("shapes do not match")  # a shard bug: the process can go on

    def decode(self, batch_ids):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def clear_cache(self, batch_id=None) -> None:
        return None


def test_unexpected_errors_are_internal_with_a_message(tmp_path: Path) -> None:
    fatal: list[BaseException] = []
    service = ShardService(_BrokenEngine())  # type: ignore[arg-type]
    with running_shard(service, tmp_path / "broken.sock", on_fatal=fatal.append) as stub:
        message = expect_status(grpc.StatusCode.INTERNAL, stub.Prefill, shard_pb2.PrefillRequest(batch_id=1))
        assert "RuntimeError" in message and "shapes do not match" in message
        stub.ClearCache(shard_pb2.ClearCacheRequest())  # the server survived
        assert fatal == []

        # A device error poisons the process: still reported, and the server is told to stop.
        decode = shard_pb2.DecodeRequest(batches=[shard_pb2.CachedBatch(id=1)])
        message = expect_status(grpc.StatusCode.INTERNAL, stub.Decode, decode)
        assert "illegal memory access" in message and "shutting down" in message
        assert [type(e) for e in fatal] == [torch.AcceleratorError]


def test_logprobs_penalties_and_bias_cross_the_proto(shard: Shard, reference_model: torch.nn.Module) -> None:
    """Every new field of the contract, over gRPC: top and prompt logprobs come back as the
    reference's log_softmax; a bias and the penalties reach the sampler; prompt_logprobs=0 (set)
    differs from absent."""
    prompt = [9, 40, 41, 7, 7]
    asking = greedy_request(21, prompt, 2, shard.pool)
    asking.sampling.top_logprobs = 3
    asking.prompt_logprobs = 2
    no_alternatives = greedy_request(22, prompt, 2, shard.pool)
    no_alternatives.prompt_logprobs = 0
    biased = greedy_request(23, prompt, 2, shard.pool)
    biased.sampling.logit_bias[77] = 100.0
    penalised = greedy_request(24, prompt, 2, shard.pool)
    penalised.sampling.frequency_penalty = 2.0
    penalised.sampling.presence_penalty = 2.0
    plain = greedy_request(25, prompt, 2, shard.pool)
    requests = [asking, no_alternatives, biased, penalised, plain]
    prefill = shard.stub.Prefill(shard_pb2.PrefillRequest(batch_id=201, requests=requests))
    decode = shard.stub.Decode(shard_pb2.DecodeRequest(batches=[prefill.batch]))
    shard.stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=201))
    first = {g.request_id: g for g in prefill.generations}
    second = {g.request_id: g for g in decode.generations}
    with torch.no_grad():
        reference = torch.log_softmax(reference_model(torch.tensor([prompt])).logits[0], dim=-1)

    top = [(t.token_id, t.logprob) for t in first[21].top_logprobs]
    expected = torch.topk(reference[-1], 3)
    assert [t for t, _ in top] == expected.indices.tolist()
    assert [lp for _, lp in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
    assert [len(g.top_logprobs) for g in prefill.generations] == [3, 0, 0, 0, 0]
    for g in (first[21], first[22]):
        assert [p.logprob for p in g.prompt_logprobs] == pytest.approx(
            [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)
    assert [len(p.top) for p in first[21].prompt_logprobs] == [2] * (len(prompt) - 1)
    assert [p.top[0].token_id for p in first[21].prompt_logprobs] == reference[:-1].argmax(dim=-1).tolist()
    # The rank crosses too: 1 where the prompt token is the reference's most likely, more elsewhere.
    expected_top = reference[:-1].argmax(dim=-1).tolist()
    for position, token, top in zip(first[21].prompt_logprobs, prompt[1:], expected_top, strict=True):
        assert (position.rank == 1) == (token == top), (position.rank, token, top)
    assert all(len(p.top) == 0 for p in first[22].prompt_logprobs)
    assert [len(g.prompt_logprobs) for g in prefill.generations] == [4, 4, 0, 0, 0]
    assert first[23].token_id == second[23].token_id == 77
    # Same first token as the plain request (nothing generated yet, the prompt does not count),
    # then that token is penalised by frequency + presence = 4.
    assert first[24].token_id == first[25].token_id
    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt + [first[24].token_id]])).logits[0, -1]
    assert second[25].token_id == int(logits.argmax())
    logits[first[24].token_id] -= 4.0
    assert second[24].token_id == int(logits.argmax())
    assert len(decode.generations[0].prompt_logprobs) == 0
