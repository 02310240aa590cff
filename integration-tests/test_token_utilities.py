"""`/tokenize` and `/detokenize` on the launched stack agree with the transformers tokenizer loaded
from the same directory: the base model's, and an adapter's own tokenizer and chat template (the
adapter's template renders differently from the base's, so the adapter's ids prove which one
the server used)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, BatchEncoding

from adapter_models import CHAT, SERVED_NAME, adapter_set, start_stack

OWN_TOKENIZER = "template/own-tokenizer"  # tokenizer files with a template of their own
TEXTS = ["Hello", "The quick brown fox", "東京と大阪", "  two spaces, tab\tand\nnewline"]
CHATS = [CHAT, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京?"}]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "token-utilities")
    yield stack
    stack.stop()


def _models(adapters) -> list[tuple[str, Path]]:
    """(model, directory its tokenizer and template come from)."""
    return [(SERVED_NAME, adapters.base_dir), (OWN_TOKENIZER, adapters.adapter_dir(OWN_TOKENIZER))]


def _ok(stack, path: str, payload: dict) -> dict:
    status, body = stack.post_json(path, payload)
    assert status == 200, (path, payload, body)
    return body


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_adapter_template_differs_from_the_base(adapters):
    """Guards the test's power: the adapter's rendering is not the base's."""
    base, own = (AutoTokenizer.from_pretrained(directory) for _, directory in _models(adapters))
    for messages in CHATS:
        assert _chat_ids(base, messages) != _chat_ids(own, messages)


def test_tokenize_prompts_as_the_tokenizer_does(adapters, stack):
    for model, directory in _models(adapters):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        for text in TEXTS:
            for add_special_tokens in (True, False):
                body = _ok(stack, "/tokenize", {"model": model, "prompt": text,
                                                "add_special_tokens": add_special_tokens,
                                                "return_token_strs": True})
                want = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
                assert body["tokens"] == want, (model, text, add_special_tokens)
                assert body["count"] == len(want)
                assert body["max_model_len"] == 512
                assert body["token_strs"] == tokenizer.convert_ids_to_tokens(want)
        # add_special_tokens defaults to true for a prompt.
        default = _ok(stack, "/tokenize", {"model": model, "prompt": TEXTS[0]})
        assert default["tokens"] == tokenizer(TEXTS[0])["input_ids"]
        assert "token_strs" not in default


def test_tokenize_messages_as_apply_chat_template(adapters, stack):
    for model, directory in _models(adapters):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        for messages in CHATS:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            want = list(encoded["input_ids"] if isinstance(encoded, BatchEncoding) else encoded)
            body = _ok(stack, "/tokenize", {"model": model, "messages": messages})
            assert body["tokens"] == want, (model, messages)
            assert body["count"] == len(want)
            without = _ok(stack, "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": False})
            assert without["tokens"] == _chat_ids(tokenizer, messages, add_generation_prompt=False)
            assert without["tokens"] != want


def test_detokenize_round_trips_as_decode(adapters, stack):
    for model, directory in _models(adapters):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        for text in TEXTS:
            ids = _ok(stack, "/tokenize", {"model": model, "prompt": text})["tokens"]
            body = _ok(stack, "/detokenize", {"model": model, "tokens": ids})
            assert body == {"prompt": tokenizer.decode(ids)}, (model, text)
        chat_ids = _ok(stack, "/v1/tokenize", {"model": model, "messages": CHATS[1]})["tokens"]
        detokenized = _ok(stack, "/v1/detokenize", {"model": model, "tokens": chat_ids})
        assert detokenized["prompt"] == tokenizer.decode(chat_ids)


def test_ids_outside_the_vocabulary_are_refused(adapters, stack):
    tokenizer = AutoTokenizer.from_pretrained(adapters.base_dir)
    last = len(tokenizer) - 1
    assert _ok(stack, "/detokenize", {"tokens": [last]})["prompt"] == tokenizer.decode([last])
    for bad in ([len(tokenizer)], [1, -1]):
        status, body = stack.post_json("/detokenize", {"tokens": bad})
        assert status == 400, body
        assert body["error"]["param"] == "tokens"
        assert body["error"]["type"] == "invalid_request_error"
    status, body = stack.post_json("/tokenize", {"model": "no/such-adapter", "prompt": "x"})
    assert (status, body["error"]["code"]) == (404, "model_not_found"), body
