"""Grammars over gRPC: CompileGrammar answers an error string (never a failed call) for a bad
grammar and reports its compile time; a Prefill whose grammar does not compile is the request's
INVALID_ARGUMENT; constrained steps report grammar_ns."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import pytest
from grammar_models import CACHE_GIB, EOS, build_grammar_model
from shard_harness import BlockPool, running_shard
from tokenizers import Tokenizer

from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
PROMPT = [7, 8, 9]


def _grammar(schema: object) -> shard_pb2.Grammar:
    return shard_pb2.Grammar(kind=shard_pb2.Grammar.KIND_JSON_SCHEMA, text=json.dumps(schema), eos_token_ids=[EOS])


Shard = tuple[shard_pb2_grpc.ShardStub, BlockPool, Tokenizer]


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shard]:
    path, tokenizer = build_grammar_model(tmp_path_factory.mktemp("grammar-service"))
    engine = Engine(str(path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=CACHE_GIB)
    with running_shard(ShardService(engine), tmp_path_factory.mktemp("sock") / "shard.sock") as stub:
        warm = stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_total_tokens=128,
                                                   max_batch_size=4))
        yield stub, BlockPool(warm.block_size, warm.num_blocks), tokenizer


def _compile(stub: Any, grammar: shard_pb2.Grammar, grammar_id: int, adapter_id: str = "") -> Any:
    request = shard_pb2.CompileGrammarRequest(adapter_id=adapter_id, grammar=grammar, grammar_id=grammar_id)
    return stub.CompileGrammar(request)


def test_compile_grammar_reports_errors_and_time(shard: Shard) -> None:
    stub = shard[0]
    first = _compile(stub, _grammar(SCHEMA), 1)
    assert first.error == "" and first.compile_ns > 0
    again = _compile(stub, _grammar(SCHEMA), 2)
    assert again.error == "" and again.compile_ns == 0
    assert "objekt" in _compile(stub, _grammar({"type": "objekt"}), 3).error
    regex = shard_pb2.Grammar(kind=shard_pb2.Grammar.KIND_REGEX, text="[a-", eos_token_ids=[EOS])
    assert "regex" in _compile(stub, regex, 4).error
    assert "not loaded" in _compile(stub, _grammar(SCHEMA), 5, adapter_id="nope").error
    stub.ReleaseGrammars(shard_pb2.ReleaseGrammarsRequest(grammar_ids=[1, 2, 3, 4, 5]))
    # The router chooses nonzero ids; 0 is its bug, not the client's.
    with pytest.raises(grpc.RpcError) as raised:
        _compile(stub, _grammar(SCHEMA), 0)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_constrained_generation_over_grpc(shard: Shard) -> None:
    stub, pool, tokenizer = shard
    max_new = 60
    constrained = shard_pb2.Request(
        id=1, input_ids=PROMPT, blocks=pool.table(len(PROMPT) + max_new), max_new_tokens=max_new,
        sampling=shard_pb2.SamplingParams(temperature=0.7, top_p=1.0, repetition_penalty=1.0, seed=4),
        grammar_id=10,
    )
    assert _compile(stub, _grammar(SCHEMA), 10).error == ""
    response = stub.Prefill(shard_pb2.PrefillRequest(batch_id=1, requests=[constrained]))
    assert 0 < response.grammar_ns <= response.forward_ns
    tokens = [response.generations[0].token_id]
    while tokens[-1] != EOS and len(tokens) < max_new:
        step = stub.Decode(shard_pb2.DecodeRequest(batches=[response.batch]))
        assert 0 < step.grammar_ns <= step.forward_ns
        tokens.append(step.generations[0].token_id)
    stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=1))
    stub.ReleaseGrammars(shard_pb2.ReleaseGrammarsRequest(grammar_ids=[10]))
    assert tokens[-1] == EOS
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)


def test_a_prefill_naming_a_grammar_not_pinned_is_invalid_argument(shard: Shard) -> None:
    stub, pool, _ = shard
    assert "objekt" in _compile(stub, _grammar({"type": "objekt"}), 20).error
    assert _compile(stub, _grammar(SCHEMA), 21).error == ""
    stub.ReleaseGrammars(shard_pb2.ReleaseGrammarsRequest(grammar_ids=[21]))
    for grammar_id in (20, 21, 22):  # refused, released, never compiled
        request = shard_pb2.Request(
            id=5, input_ids=PROMPT, blocks=pool.table(len(PROMPT) + 4), max_new_tokens=4,
            sampling=shard_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0), grammar_id=grammar_id,
        )
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefill(shard_pb2.PrefillRequest(batch_id=5, requests=[request]))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"grammar {grammar_id} is not pinned" in (raised.value.details() or "")
