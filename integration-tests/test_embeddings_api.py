"""`POST /v1/embeddings` on the real stack, through the official openai SDK and langchain's
`OpenAIEmbeddings`. The served model is a tiny Llama that ships sentence-transformers files
(mean pooling, then Normalize), so the reference for the base model is `SentenceTransformer`
loading the same directory, and for an adapter sentence-transformers' Pooling and Normalize
modules over peft's hidden states. Float and base64 vectors agree, token-id inputs equal text
inputs, every response validates against OpenAI's `CreateEmbeddingResponse` with closed
objects, refusals name their field, and an embedding needs no batch slot: with
`--max-batch-size 1` held by a streaming chat, it is answered while the stream runs."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from langchain_openai import OpenAIEmbeddings
from pydantic import SecretStr
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
from transformers import AutoTokenizer

import openai_schema
from adapter_models import ADAPTER_KINDS, SHARD_ENV, build_adapter, peft_model
from model_builders import build_model_dir
from sentence_transformers_files import write_pipeline
from stack import Stack, StackConfig

SERVED_NAME = "tiny-embedder"
ADAPTER = "tuned"
TEXTS = ["The quick brown fox", "a river runs through it", "東京と大阪", "x"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("embeddings")
    base = build_model_dir("llama", tmp / "causal", seed=21)
    model_dir = tmp / "model"
    shutil.copytree(base, model_dir)
    write_pipeline(model_dir, {"embedding_dimension": 64, "pooling_mode": "mean"})
    root = tmp / "adapters"
    build_adapter(model_dir, root / ADAPTER, seed=22, **ADAPTER_KINDS["rank8"])
    return {"model": model_dir, "adapter": root / ADAPTER, "root": root}


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    config = StackConfig(
        model_id=str(model["model"]), served_model_name=SERVED_NAME, max_input_tokens=256, max_total_tokens=512,
        max_batch_size=1,
        extra_args=["--adapter-source", "local", "--adapter-root", str(model["root"]), "--max-lora-rank", "8"],
        extra_env=SHARD_ENV,
    )
    with Stack(config, tmp_path_factory.mktemp("logs") / "embeddings.log") as running:
        yield running


def _sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.base_url + "/v1/embeddings", json=body, timeout=120)


def _reference_base(model_dir: Path, texts: list[str]) -> np.ndarray:
    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_numpy=True)


def _reference_adapter(model: dict[str, Path], texts: list[str]) -> list[torch.Tensor]:
    """peft's last hidden states (the base under the adapter, its LM head unused), pooled by
    sentence-transformers' modules loaded from the model's own files."""
    tuned = peft_model(str(model["model"]), str(model["adapter"]))
    tokenizer = AutoTokenizer.from_pretrained(model["model"])
    pooling = Pooling.load(str(model["model"] / "1_Pooling"))
    vectors = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = tuned(**ids, output_hidden_states=True).hidden_states[-1]
        features = Normalize()(pooling({"token_embeddings": hidden, "attention_mask": ids["attention_mask"]}))
        vectors.append(features["sentence_embedding"][0])
    return vectors


def _assert_close(got: Any, want: Any, what: str) -> None:
    got_t, want_t = torch.tensor(np.asarray(got), dtype=torch.float32), torch.tensor(np.asarray(want))
    cosine = torch.nn.functional.cosine_similarity(got_t, want_t.float(), dim=0).item()
    assert cosine >= 0.9999, f"{what}: cosine {cosine}"


def test_the_sdk_gets_sentence_transformers_vectors_as_float_and_base64(stack, model):
    want = _reference_base(model["model"], TEXTS)
    with _sdk(stack) as sdk:
        floats = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
        # The SDK asks for base64 by default and decodes it into floats itself.
        decoded = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for i, text in enumerate(TEXTS):
        _assert_close(floats.data[i].embedding, want[i], f"float {text!r}")
        # The JSON numbers are float32's shortest spelling: as float32 they are the base64 bytes.
        np.testing.assert_array_equal(np.asarray(floats.data[i].embedding, dtype=np.float32),
                                      np.asarray(decoded.data[i].embedding, dtype=np.float32))
    tokenizer = AutoTokenizer.from_pretrained(model["model"])
    expected_tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == expected_tokens
    assert floats.model == SERVED_NAME


def test_every_response_is_openais_closed_schema(stack):
    """OpenAI's schema describes the float form; a base64 vector is checked as the floats its
    bytes hold."""
    for body in ({"input": "one text"}, {"input": TEXTS, "encoding_format": "base64"}, {"input": [[5, 6, 7]]}):
        response = _post(stack, {"model": SERVED_NAME, **body})
        assert response.status_code == 200, response.text
        answer = response.json()
        if body.get("encoding_format") == "base64":
            for item in answer["data"]:
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
                assert len(item["embedding"]) == 64
        openai_schema.validate(answer, "CreateEmbeddingResponse", closed=True)


def test_an_adapter_embeds_with_its_weights(stack, model):
    with _sdk(stack) as sdk:
        tuned = sdk.embeddings.create(model=ADAPTER, input=TEXTS, encoding_format="float")
        base = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
    for text, got, want, untuned in zip(TEXTS, tuned.data, _reference_adapter(model, TEXTS), base.data, strict=True):
        _assert_close(got.embedding, want, f"adapter {text!r}")
        assert np.dot(got.embedding, untuned.embedding) < 0.999, "the adapter changes the vector"
    assert tuned.model == ADAPTER


def test_token_ids_embed_as_their_text_does(stack, model):
    tokenizer = AutoTokenizer.from_pretrained(model["model"])
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    with _sdk(stack) as sdk:
        from_ids = sdk.embeddings.create(model=SERVED_NAME, input=ids, encoding_format="float")
        from_one = sdk.embeddings.create(model=SERVED_NAME, input=ids[0], encoding_format="float")
        from_text = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
    for a, b in zip(from_ids.data, from_text.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    np.testing.assert_allclose(from_one.data[0].embedding, from_text.data[0].embedding, atol=1e-6)
    # Without special tokens the text loses its BOS: another sequence, another vector.
    bare = _post(stack, {"model": SERVED_NAME, "input": TEXTS[0], "add_special_tokens": False,
                         "encoding_format": "float"}).json()
    assert bare["usage"]["prompt_tokens"] == len(ids[0]) - 1
    want = _reference_base(model["model"], [TEXTS[0]])[0]
    assert float(np.dot(bare["data"][0]["embedding"], want)) < 0.9999


def test_langchain_openai_embeddings(stack, model):
    """langchain's OpenAIEmbeddings, told to send texts as they are (its default counts tokens
    with tiktoken, whose encodings cannot be fetched here)."""
    embedder = OpenAIEmbeddings(base_url=stack.base_url + "/v1", api_key=SecretStr("unused"), model=SERVED_NAME,
                                check_embedding_ctx_length=False, max_retries=0)
    documents = embedder.embed_documents(TEXTS[:3])
    query = embedder.embed_query(TEXTS[3])
    want = _reference_base(model["model"], TEXTS)
    for i, vector in enumerate([*documents, query]):
        _assert_close(vector, want[i], f"langchain {TEXTS[i]!r}")


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"input": "x", "dimensions": 32}, "dimensions", 400),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": ""}, "input", 400),
    ({"input": ["a", ""]}, "input[1]", 400),
    ({"input": []}, "input", 400),
    ({"input": [[1, 2], []]}, "input[1]", 400),
    ({"input": [1, 999999]}, "input", 400),
    ({"input": [[7] * 300]}, "input[0]", 400),
    ({"input": [7] * 300}, "input", 400),
    ({"input": "word " * 2000}, "input", 400),
    ({"input": {"text": "x"}}, "input", 400),
    ({}, "input", 400),
])
def test_refusals_name_their_field(stack, body, param, status):
    response = _post(stack, {"model": SERVED_NAME, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert _post(stack, {"model": SERVED_NAME, "input": "still serving"}).status_code == 200


def test_a_request_takes_2048_inputs_as_openai_does(stack, model):
    """OpenAI's embeddings endpoint takes up to 2,048 inputs per request, and 300,000 tokens over
    all of them. Inputs are not choices: `--max-choices-per-request` (512 here, its default)
    does not count them. The vectors come back in input order (the first and last checked
    against sentence-transformers)."""
    texts = [f"input number {i}" for i in range(2048)]
    with _sdk(stack) as sdk:
        embedded = sdk.embeddings.create(model=SERVED_NAME, input=texts)
    assert [item.index for item in embedded.data] == list(range(2048))
    want = _reference_base(model["model"], [texts[0], texts[-1]])
    _assert_close(embedded.data[0].embedding, want[0], texts[0])
    _assert_close(embedded.data[-1].embedding, want[1], texts[-1])
    too_many = _post(stack, {"model": SERVED_NAME, "input": [*texts, "one more"]})
    assert too_many.status_code == 400, too_many.text
    assert too_many.json()["error"]["param"] == "input"
    assert "at most 2048" in too_many.json()["error"]["message"]
    # 2,048 inputs of 147 token ids: 301,056 tokens, each input well within --max-input-tokens.
    over_budget = _post(stack, {"model": SERVED_NAME, "input": [[7] * 147] * 2048})
    assert over_budget.status_code == 400, over_budget.text
    error = over_budget.json()["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded"), error
    assert "300000" in error["message"], error


def test_an_unknown_model_is_404_and_an_unknown_field_is_named(stack):
    missing = _post(stack, {"model": "gpt-4", "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    extra = _post(stack, {"model": SERVED_NAME, "input": "x", "truncate_prompt_tokens": 3, "user": "u-1"})
    assert extra.status_code == 200
    assert extra.headers["quiver-ignored-fields"] == "truncate_prompt_tokens"


def test_embeddings_are_counted_and_need_no_batch_slot(stack):
    """With --max-batch-size 1, a streaming chat holds the only batch slot; an embedding request
    sent while it streams is answered before the stream ends, and the stream then runs to its
    full length. The counters grow by the inputs and their tokens."""
    before = stack.metrics()
    with _sdk(stack) as sdk:
        stream = sdk.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Go on."}],
                                             max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # the chat is running: it holds the slot
        embedded = sdk.embeddings.create(model=SERVED_NAME, input=TEXTS, encoding_format="float")
        running = stack.metrics()["quiver_requests_running"]
        rest = list(chunks)
    assert running == 1, "the chat was still decoding when the embeddings came back"
    assert rest[-1].choices[0].finish_reason == "length"
    after = stack.metrics()
    assert after["quiver_embedding_inputs_total"] - before["quiver_embedding_inputs_total"] == len(TEXTS)
    grown = after["quiver_embedding_tokens_total"] - before["quiver_embedding_tokens_total"]
    assert grown == embedded.usage.prompt_tokens


def test_info_describes_the_pooling(stack):
    status, body = stack.get("/info")
    assert status == 200
    info = json.loads(body)["embeddings"]
    assert info == {"dimensions": 64, "pooling": "mean, L2-normalized (sentence-transformers)", "unavailable": None}
