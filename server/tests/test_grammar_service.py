"""Grammars over gRPC: CompileGrammar answers an error string (never a failed call) for a bad
grammar and reports its compile time; a Prefill whose grammar does not compile is the request's
INVALID_ARGUMENT; constrained steps report grammar_ns."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
from grammar_models import CACHE_GIB, EOS, build_grammar_model
from shard_harness import BlockPool, running_shard
from tokenizers import Tokenizer

from quiver_server.engine import Engine
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


def test_compile_grammar_reports_errors_and_time(shard: Shard) -> None:
    stub = shard[0]
    first = stub.CompileGrammar(shard_pb2.CompileGrammarRequest(grammar=_grammar(SCHEMA)))
    assert first.error == "" and first.compile_ns > 0
    again = stub.CompileGrammar(shard_pb2.CompileGrammarRequest(grammar=_grammar(SCHEMA)))
    assert again.error == "" and again.compile_ns == 0
    bad = stub.CompileGrammar(shard_pb2.CompileGrammarRequest(grammar=_grammar({"type": "objekt"})))
    assert "objekt" in bad.error
    regex = shard_pb2.Grammar(kind=shard_pb2.Grammar.KIND_REGEX, text="[a-", eos_token_ids=[EOS])
    assert "regex" in stub.CompileGrammar(shard_pb2.CompileGrammarRequest(grammar=regex)).error
    unknown = stub.CompileGrammar(shard_pb2.CompileGrammarRequest(adapter_id="nope", grammar=_grammar(SCHEMA)))
    assert "not loaded" in unknown.error


def test_constrained_generation_over_grpc(shard: Shard) -> None:
    stub, pool, tokenizer = shard
    max_new = 60
    constrained = shard_pb2.Request(
        id=1, input_ids=PROMPT, blocks=pool.table(len(PROMPT) + max_new), max_new_tokens=max_new,
        sampling=shard_pb2.SamplingParams(temperature=0.7, top_p=1.0, repetition_penalty=1.0, seed=4),
        grammar=_grammar(SCHEMA),
    )
    response = stub.Prefill(shard_pb2.PrefillRequest(batch_id=1, requests=[constrained]))
    assert 0 < response.grammar_ns <= response.forward_ns
    tokens = [response.generations[0].token_id]
    while tokens[-1] != EOS and len(tokens) < max_new:
        step = stub.Decode(shard_pb2.DecodeRequest(batches=[response.batch]))
        assert 0 < step.grammar_ns <= step.forward_ns
        tokens.append(step.generations[0].token_id)
    stub.ClearCache(shard_pb2.ClearCacheRequest(batch_id=1))
    assert tokens[-1] == EOS
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)


def test_a_prefill_with_a_bad_grammar_is_invalid_argument(shard: Shard) -> None:
    stub, pool, _ = shard
    bad = shard_pb2.Request(
        id=5, input_ids=PROMPT, blocks=pool.table(len(PROMPT) + 4), max_new_tokens=4,
        sampling=shard_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0), grammar=_grammar({"type": "objekt"}),
    )
    with pytest.raises(grpc.RpcError) as raised:
        stub.Prefill(shard_pb2.PrefillRequest(batch_id=5, requests=[bad]))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "objekt" in (raised.value.details() or "")
