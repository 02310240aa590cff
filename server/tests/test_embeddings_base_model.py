"""Decoder embedding models saved as their bare backbone, as Qwen3-Embedding (`Qwen3Model`, tied
embeddings) and e5-mistral (`MistralModel`, untied) publish them: tensors without the `model.`
prefix, no `lm_head.weight`, sentence-transformers files choosing last-token pooling and
Normalize. The engine's embeddings are `SentenceTransformer`'s loading the same directory. The
tied model still generates, greedy as transformers' causal LM loaded from that directory; the
untied one has no LM head, and a generating request is refused with the reason (over gRPC:
INVALID_ARGUMENT) while embeddings serve on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from block_tables import Blocks
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from shard_harness import running_shard
from tiny_adapters import assert_greedy_matches, peft_reference, reference_greedy
from tiny_models import TINY_SHAPE, build_tiny_model
from transformers import PreTrainedTokenizerFast

from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.engine import Engine
from quiver_server.pb import shard_pb2
from quiver_server.service import ShardService
from quiver_server.tiny_model import ENDOFTEXT, IM_END, train_tokenizer

TEXTS = ["The quick brown fox", "a river runs through it", "x", "Привет, мир. 你好, 世界"]
NEW_TOKENS = 8
# modules.json as sentence-transformers' current releases write it.
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling",
     "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"},
]
# Qwen3-Embedding's 1_Pooling/config.json, at the tiny width.
POOLING = {"word_embedding_dimension": TINY_SHAPE["hidden_size"], "pooling_mode_cls_token": False,
           "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
           "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
           "pooling_mode_lasttoken": True, "include_prompt": True}


@dataclass(frozen=True)
class Checkpoint:
    arch: str
    tied: bool
    max_shard_size: str | None  # sharded: the layout is told by every shard's tensor names


CHECKPOINTS = {
    "qwen3-tied": Checkpoint("qwen3", tied=True, max_shard_size=None),
    "mistral-untied": Checkpoint("mistral", tied=False, max_shard_size="100KB"),
}


@dataclass
class Served:
    checkpoint: Checkpoint
    model_dir: Path
    engine: Engine


def _embedding_model(directory: Path, checkpoint: Checkpoint, seed: int) -> Path:
    path = build_tiny_model(directory, checkpoint.arch, seed=seed, tie_word_embeddings=checkpoint.tied,
                            max_shard_size=checkpoint.max_shard_size, base_model=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(TINY_SHAPE["vocab_size"]),
                                        eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps(MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(POOLING))
    (path / "2_Normalize").mkdir()
    return path


def _tensor_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _served(name: str, tmp_path_factory: pytest.TempPathFactory) -> Served:
    checkpoint = CHECKPOINTS[name]
    model_dir = _embedding_model(tmp_path_factory.mktemp(name), checkpoint, seed=31)
    # The checkpoint is laid out as the published ones are.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [{"qwen3": "Qwen3Model", "mistral": "MistralModel"}[checkpoint.arch]]
    names = _tensor_names(model_dir)
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    engine = Engine(str(model_dir), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=0.01)
    engine.warmup(256, 128, 8)
    return Served(checkpoint, model_dir, engine)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return _served("qwen3-tied", tmp_path_factory)


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return _served("mistral-untied", tmp_path_factory)


def _embed(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    blocks = Blocks()
    requests = [RequestSpec(id=i, input_ids=p, blocks=blocks.table(len(p)), max_new_tokens=0, embed=True)
                for i, p in enumerate(prompts)]
    step = engine.prefill(0, requests)
    by_id = {g.request_id: g.embedding for g in step.generations}
    return [by_id[r.id] for r in requests]


@pytest.mark.parametrize("checkpoint", ["tied", "untied"])
def test_embeddings_equal_sentence_transformers(checkpoint: str, request: pytest.FixtureRequest) -> None:
    served: Served = request.getfixturevalue(checkpoint)
    reference = SentenceTransformer(str(served.model_dir), device="cpu")
    prompts = [reference.tokenize([text])["input_ids"][0].tolist() for text in TEXTS]
    want = reference.encode(TEXTS, convert_to_tensor=True)
    assert served.engine.info.pooling == "last, L2-normalized (sentence-transformers)"
    for text, got, wanted in zip(TEXTS, _embed(served.engine, prompts), want, strict=True):
        got_t = torch.tensor(got)
        cosine = torch.nn.functional.cosine_similarity(got_t, wanted.float(), dim=0).item()
        assert cosine >= 0.9999, f"{served.checkpoint}: {text!r}: cosine {cosine}"
        torch.testing.assert_close(got_t, wanted.float(), atol=1e-4, rtol=1e-4, msg=f"{served.checkpoint}: {text!r}")


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    request = RequestSpec(id=1, input_ids=prompt, blocks=Blocks().table(len(prompt) + NEW_TOKENS),
                          max_new_tokens=NEW_TOKENS)
    tokens = [g.token_id for g in engine.prefill(5, [request]).generations]
    while len(tokens) < NEW_TOKENS:
        tokens += [g.token_id for g in engine.decode([5]).generations]
    engine.clear_cache(5)
    return tokens


def test_a_tied_base_model_generates_as_transformers_loads_it(tied: Served) -> None:
    """transformers loads the bare checkpoint into its causal LM by the same prefix, its LM head
    the embedding matrix."""
    assert tied.engine.info.generation_refusal == ""
    prompt = [5, 17, 42, 9, 120, 33, 7]
    want = reference_greedy(peft_reference(tied.model_dir, None), prompt, NEW_TOKENS)
    assert_greedy_matches(_greedy(tied.engine, prompt), want, str(tied.checkpoint))


def test_an_untied_base_model_embeds_only_and_says_why(untied: Served, tmp_path: Path) -> None:
    engine = untied.engine
    assert "no LM head" in engine.info.generation_refusal
    prompt = [5, 17, 42, 9]
    generating = RequestSpec(id=1, input_ids=prompt, blocks=Blocks().table(len(prompt) + 4), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"request 1: .*mistral checkpoint is a bare base model.*embeddings only"):
        engine.prefill(3, [generating])
    # Over gRPC the router gets the reason as INVALID_ARGUMENT, and the shard serves on.
    greedy = shard_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    with running_shard(ShardService(engine), tmp_path / "shard.sock") as stub:
        request = shard_pb2.Request(id=2, input_ids=prompt, blocks=[0], max_new_tokens=4, sampling=greedy)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Prefill(shard_pb2.PrefillRequest(batch_id=4, requests=[request]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "embeddings only" in (refused.value.details() or "")
        embedded = stub.Prefill(shard_pb2.PrefillRequest(batch_id=4, requests=[
            shard_pb2.Request(id=3, input_ids=prompt, blocks=[0], embed=True, sampling=greedy)]))
    torch.testing.assert_close(torch.tensor(list(embedded.generations[0].embedding)),
                               torch.tensor(_embed(engine, [prompt])[0]), atol=1e-6, rtol=1e-6)
