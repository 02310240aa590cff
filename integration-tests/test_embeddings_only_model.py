"""An embeddings-only checkpoint on the real stack, through the official openai SDK: a bare
`MistralModel` as e5-mistral publishes it (tensors without the `model.` prefix, no
`lm_head.weight`, untied embeddings) with sentence-transformers files choosing last-token
pooling and Normalize. It has no LM head, so it serves embeddings only: its vectors are
`SentenceTransformer`'s loading the same directory, and every chat, completions and Responses
request, streamed or not, is refused up front as OpenAI's 400 (`code: "generation_unavailable"`,
`param: "model"`, naming the missing LM head), without reaching the scheduler. Embeddings,
/health and /info serve on afterwards.

Embedding checkpoints ship with a chat template (Qwen3-Embedding) or without one (as the
shard-level fixture in server/tests/test_embeddings_base_model.py writes its tokenizer); the
refusal is the same for both."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer, MistralConfig, MistralModel

import openai_schema
from adapter_models import SHARD_ENV
from model_builders import BOS, EOS, PAD, build_tokenizer
from sentence_transformers_files import write_pipeline
from stack import Stack, StackConfig

SERVED_NAME = "tiny-e5"
TEXTS = ["The quick brown fox", "a river runs through it", "東京と大阪", "x"]
HIDDEN = 64
# e5-mistral's (and Qwen3-Embedding's) 1_Pooling/config.json, at the tiny width.
POOLING = {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
           "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
           "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
           "pooling_mode_lasttoken": True, "include_prompt": True}
# Whether the checkpoint's tokenizer has a chat template.
CHECKPOINTS = {"chat-template": True, "no-chat-template": False}


def build_embedding_model(out_dir: Path, chat_template: bool, seed: int = 41) -> Path:
    """A tiny bare `MistralModel` (untied embeddings, so no LM head) saved as the backbone
    alone, with the integration tests' tokenizer and sentence-transformers files."""
    tokenizer = build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    vocab = tokenizer.get_vocab()
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=vocab[BOS], eos_token_id=vocab[EOS], pad_token_id=vocab[PAD],
        tie_word_embeddings=False, initializer_range=0.1, sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    MistralModel(config).save_pretrained(out_dir)  # float32, torch's default
    tokenizer.save_pretrained(out_dir)
    write_pipeline(out_dir, POOLING)
    return out_dir


def _tensor_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


class Served:
    def __init__(self, model_dir: Path, stack: Stack):
        self.model_dir = model_dir
        self.stack = stack

    def sdk(self) -> openai.OpenAI:
        # No retries: a 4xx/5xx surfaces as the error it is.
        return openai.OpenAI(base_url=self.stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    name: str = request.param
    model_dir = build_embedding_model(tmp_path_factory.mktemp(name) / "model", CHECKPOINTS[name])
    # Laid out as the published bare checkpoints are.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["MistralModel"] and config["tie_word_embeddings"] is False
    names = _tensor_names(model_dir)
    assert "embed_tokens.weight" in names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    stack_config = StackConfig(model_id=str(model_dir), served_model_name=SERVED_NAME, max_input_tokens=256,
                               max_total_tokens=512, extra_env=SHARD_ENV)
    with Stack(stack_config, tmp_path_factory.mktemp("logs") / f"{name}.log") as running:
        yield Served(model_dir, running)


def _assert_close(got: Any, want: Any, what: str) -> None:
    got_t = torch.tensor(np.asarray(got), dtype=torch.float32)
    want_t = torch.tensor(np.asarray(want), dtype=torch.float32)
    cosine = torch.nn.functional.cosine_similarity(got_t, want_t, dim=0).item()
    assert cosine >= 0.9999, f"{what}: cosine {cosine}"
    torch.testing.assert_close(got_t, want_t, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _embed_and_check(served: Served, texts: list[str]) -> None:
    """The SDK's vectors (float, schema-checked as sent, and its default base64) against
    SentenceTransformer loading the same directory."""
    want = SentenceTransformer(str(served.model_dir), device="cpu").encode(texts, convert_to_numpy=True)
    with served.sdk() as sdk:
        raw = sdk.embeddings.with_raw_response.create(model=SERVED_NAME, input=texts, encoding_format="float")
        decoded = sdk.embeddings.create(model=SERVED_NAME, input=texts)
    openai_schema.validate(raw.http_response.json(), "CreateEmbeddingResponse", closed=True)
    floats = raw.parse()
    assert [d.index for d in floats.data] == list(range(len(texts)))
    assert floats.model == SERVED_NAME
    for i, text in enumerate(texts):
        assert len(floats.data[i].embedding) == HIDDEN
        _assert_close(floats.data[i].embedding, want[i], f"float {text!r}")
        np.testing.assert_array_equal(np.asarray(floats.data[i].embedding, dtype=np.float32),
                                      np.asarray(decoded.data[i].embedding, dtype=np.float32))
    tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
    assert floats.usage.prompt_tokens == sum(len(tokenizer(text)["input_ids"]) for text in texts)


def test_embeddings_equal_sentence_transformers(served: Served) -> None:
    _embed_and_check(served, TEXTS)
    status, body = served.stack.get("/info")
    assert status == 200
    assert json.loads(body)["embeddings"] == {"dimensions": HIDDEN, "unavailable": None,
                                              "pooling": "last, L2-normalized (sentence-transformers)"}


MESSAGES: Any = [{"role": "user", "content": "Say something."}]
# Each generating call of the SDK, streamed or not; a streamed call raises before it yields.
GENERATIONS: dict[str, Callable[[openai.OpenAI], Any]] = {
    "chat": lambda sdk: sdk.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4),
    "chat-stream": lambda sdk: list(sdk.chat.completions.create(model=SERVED_NAME, messages=MESSAGES,
                                                                max_tokens=4, stream=True)),
    "completions": lambda sdk: sdk.completions.create(model=SERVED_NAME, prompt="Once upon", max_tokens=4),
    "completions-stream": lambda sdk: list(sdk.completions.create(model=SERVED_NAME, prompt="Once upon",
                                                                  max_tokens=4, stream=True)),
    "responses": lambda sdk: sdk.responses.create(model=SERVED_NAME, input="Say something.", max_output_tokens=4),
    "responses-stream": lambda sdk: list(sdk.responses.create(model=SERVED_NAME, input="Say something.",
                                                              max_output_tokens=4, stream=True)),
}


def _scheduled(served: Served) -> dict[str, float]:
    metrics = served.stack.metrics()
    return {name: metrics[name] for name in ("quiver_prefill_steps_total", "quiver_prompt_tokens_total")}


@pytest.mark.parametrize("call", list(GENERATIONS))
def test_generation_is_refused_naming_the_missing_lm_head(served: Served, call: str) -> None:
    before = _scheduled(served)
    with served.sdk() as sdk, pytest.raises(openai.BadRequestError) as caught:
        GENERATIONS[call](sdk)
    error = caught.value
    body = error.response.json()
    assert (error.status_code, error.code, error.param) == (400, "generation_unavailable", "model"), body
    assert "serves no generation" in error.message and "no LM head" in error.message, body
    openai_schema.validate(body, "ErrorResponse")
    assert body["error"]["type"] == "invalid_request_error"
    # Refused before the scheduler: no step ran, no prompt token was counted.
    assert _scheduled(served) == before


def test_embeddings_and_health_serve_on_after_the_refusals(served: Served) -> None:
    with served.sdk() as sdk:
        for call in GENERATIONS.values():
            with pytest.raises(openai.BadRequestError):
                call(sdk)
    before = _scheduled(served)
    _embed_and_check(served, ["one more text"])
    # The counters the refusals left alone do count what is scheduled.
    after = _scheduled(served)
    assert all(after[name] > before[name] for name in before), (before, after)
    assert served.stack.get("/health")[0] == 200
    status, body = served.stack.get("/info")
    assert status == 200 and json.loads(body)["served_model_name"] == SERVED_NAME
