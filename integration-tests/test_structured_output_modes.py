"""The other ways to constrain output, through the whole stack on random-weight models:
`response_format: json_object`; vLLM's `structured_outputs` (regex, choice, json, Lark grammar)
and its older `guided_*` aliases; `response_format` on legacy /v1/completions; `n` > 1 with a
seed (every choice valid, logprobs for every token); logprobs that stay the model's raw logprobs
(checked against transformers); a grammar cut short by max_tokens ends with "length"; and a
finished grammar ends the request even under `ignore_eos`.

Each check is an independent reference: `json.loads`, `jsonschema`, `re.fullmatch` with a Python
regex equivalent to the grammar, membership in the choices, transformers' log_softmax."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from adapter_models import peft_model
from client_streams import join_chat
from structured_checks import (
    CHAT,
    LORA,
    MAX_TOKENS,
    MODELS,
    OWN_TOKENIZER,
    json_schema_format,
    load_schema,
    post,
    start_structured_stack,
    stream_chat,
    structured_set,
    validate,
)

BASE = MODELS[0]
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta", "東京"]
# A Lark grammar for llguidance, and the Python regex that accepts exactly its language.
LARK = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-z]{2,5}/\n'
LARK_EQUIVALENT = r"(hello|hi) [a-z]{2,5}"
SCHEMA_NAME = "refs_defs"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_structured_stack(tmp_path_factory, "structured-modes")
    yield stack
    stack.stop()


def chat(model: str = BASE, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def content(response: dict[str, Any], index: int = 0) -> str:
    choice = response["choices"][index]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), repr(text)


def check_choice(text: str) -> None:
    assert text in CHOICES, repr(text)


def check_lark(text: str) -> None:
    assert re.fullmatch(LARK_EQUIVALENT, text), repr(text)


def check_schema(text: str) -> None:
    validate(load_schema(SCHEMA_NAME), text)


# Each constraint, spelled as `structured_outputs` and as its `guided_*` alias, with its check.
CONSTRAINTS: list[tuple[str, Any, str, Any]] = [
    ("regex", REGEX, "guided_regex", check_regex),
    ("choice", CHOICES, "guided_choice", check_choice),
    ("grammar", LARK, "guided_grammar", check_lark),
    ("json", load_schema(SCHEMA_NAME), "guided_json", check_schema),
]
SPELLINGS = [(key, value, "structured_outputs", check) for key, value, _, check in CONSTRAINTS] + [
    (key, value, alias, check) for key, value, alias, check in CONSTRAINTS
]


def spelling_body(key: str, value: Any, field: str, model: str) -> dict[str, Any]:
    if field == "structured_outputs":
        return chat(model, structured_outputs={key: value})
    return chat(model, **{field: value})


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("key", "value", "field", "check"), SPELLINGS,
                         ids=[f"{field}-{key}" for key, _, field, _ in SPELLINGS])
def test_structured_outputs_and_aliases(stack, key, value, field, check, model):
    body = spelling_body(key, value, field, model)
    with ThreadPoolExecutor(max_workers=2) as pool:
        plain = pool.submit(post, stack, "/v1/chat/completions", body)
        streamed = pool.submit(lambda: join_chat(stream_chat(stack, body)))
        check(content(plain.result()))
        joined = streamed.result()
    check(joined.text)
    assert joined.finish_reasons == ["stop"], joined.finish_reasons


def test_structured_outputs_json_true_is_any_object(stack):
    """`json: {}`-like: any JSON object (vLLM accepts an empty schema object)."""
    text = content(post(stack, "/v1/chat/completions", chat(structured_outputs={"json": {"type": "object"}})))
    assert isinstance(json.loads(text), dict), text


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return structured_set(tmp_path_factory).base_dir


def closing_bias(tmp_path_factory, model: str) -> dict[str, int]:
    """logit_bias toward the closing quote and brace, in `model`'s own vocabulary. JSON mode
    leaves keys and strings unbounded, and a random model may wander through them until
    max_tokens; the bias (which the contract applies under grammars too) makes it close them."""
    models = structured_set(tmp_path_factory)
    tokenizer_dir = models.root / OWN_TOKENIZER if model == OWN_TOKENIZER else models.base_dir
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return {str(vocab['"']): 6, str(vocab["}"]): 6}


@pytest.mark.parametrize("model", MODELS)
def test_json_object(stack, tmp_path_factory, model):
    body = chat(model, response_format={"type": "json_object"}, logit_bias=closing_bias(tmp_path_factory, model))
    text = content(post(stack, "/v1/chat/completions", body))
    assert isinstance(json.loads(text), dict), repr(text)


def test_json_object_sampled(stack, tmp_path_factory):
    body = chat(response_format={"type": "json_object"}, temperature=1.0, seed=1234, n=4,
                logit_bias=closing_bias(tmp_path_factory, BASE))
    response = post(stack, "/v1/chat/completions", body)
    assert len(response["choices"]) == 4
    for index in range(4):
        text = content(response, index)
        assert isinstance(json.loads(text), dict), repr(text)


@pytest.mark.parametrize("model", [BASE, LORA])
def test_completions_json_schema(stack, model):
    schema = load_schema("nested_address")
    body = {"model": model, "prompt": "A record:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": json_schema_format("nested_address", schema)}
    choice = post(stack, "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    validate(schema, choice["text"])


def test_completions_regex(stack):
    body = {"model": BASE, "prompt": "Code:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "structured_outputs": {"regex": REGEX}}
    choice = post(stack, "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    check_regex(choice["text"])


@pytest.mark.parametrize("model", [BASE, OWN_TOKENIZER])
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "stream"])
def test_n_with_seed_and_logprobs(stack, model, streamed):
    """Every choice validates; each generated token has its logprob (and 2 alternatives)."""
    schema = load_schema("array_of_objects")
    body = chat(model, response_format=json_schema_format("items", schema), temperature=1.0, seed=42, n=3,
                logprobs=True, top_logprobs=2, return_token_ids=True)
    if streamed:
        chunks = stream_chat(stack, body)
        for index in range(3):
            own = [{**chunk, "choices": [c for c in chunk["choices"] if c["index"] == index]} for chunk in chunks]
            joined = join_chat(own)
            validate(schema, joined.text)
            assert joined.finish_reasons == ["stop"]
            streamed_ids = [token for chunk in own for choice in chunk["choices"]
                            for token in choice.get("token_ids") or []]
            assert streamed_ids and len(joined.logprobs) == len(streamed_ids), (len(joined.logprobs), len(streamed_ids))
            assert all(len(entry["top_logprobs"]) == 2 for entry in joined.logprobs)
        return
    response = post(stack, "/v1/chat/completions", body)
    assert len(response["choices"]) == 3
    for index, choice in enumerate(response["choices"]):
        validate(schema, content(response, index))
        entries = choice["logprobs"]["content"]
        assert len(entries) == len(choice["token_ids"]), (len(entries), len(choice["token_ids"]))
        assert all(len(entry["top_logprobs"]) == 2 for entry in entries)
    assert response["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in response["choices"])


def test_logprobs_are_raw_model_logprobs(stack, base_dir):
    """The grammar masks what may be sampled, not what is reported: each token's logprob is the
    log_softmax of the unmasked logits (transformers, teacher-forced on prompt + output)."""
    body = chat(response_format=json_schema_format("person", load_schema("person")), logprobs=True,
                return_token_ids=True)
    response = post(stack, "/v1/chat/completions", body)
    validate(load_schema("person"), content(response))
    prompt, generated = response["prompt_token_ids"], response["choices"][0]["token_ids"]
    model = peft_model(str(base_dir), None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + generated])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    entries = response["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(generated)
    for i, token in enumerate(generated):
        want = float(rows[len(prompt) + i - 1][token])
        assert abs(entries[i]["logprob"] - want) <= TOLERANCE, f"token {i}: served {entries[i]['logprob']}, raw {want}"


def test_max_tokens_too_small_ends_with_length(stack):
    body = chat(response_format=json_schema_format("person", load_schema("person")), max_tokens=3)
    response = post(stack, "/v1/chat/completions", body)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert response["usage"]["completion_tokens"] == 3
    joined = join_chat(stream_chat(stack, body))
    assert joined.finish_reasons == ["length"]
    assert joined.text == choice["message"]["content"]


def test_complete_grammar_ends_despite_ignore_eos(stack):
    """Once the grammar is complete only EOS is allowed, so the request stops there even with
    ignore_eos and min_tokens."""
    body = chat(response_format=json_schema_format("booleans", load_schema("booleans")), ignore_eos=True,
                min_tokens=200)
    validate(load_schema("booleans"), content(post(stack, "/v1/chat/completions", body)))


def test_penalties_keep_output_valid(stack):
    """Penalties reshape the logits before the mask; the grammar still decides what is allowed."""
    schema = load_schema("nested_arrays")
    body = chat(response_format=json_schema_format("matrix", schema), frequency_penalty=1.5, presence_penalty=1.0,
                repetition_penalty=1.3)
    validate(schema, content(post(stack, "/v1/chat/completions", body)))


def test_logit_bias_cannot_break_the_grammar(stack, base_dir):
    """A huge bias toward a token the regex never allows changes nothing about validity."""
    vocab = json.loads((base_dir / "tokenizer.json").read_text())["model"]["vocab"]
    body = chat(structured_outputs={"regex": "[0-9]{4}"}, logit_bias={str(vocab["x"]): 100, str(vocab["{"]): 100})
    text = content(post(stack, "/v1/chat/completions", body))
    assert re.fullmatch("[0-9]{4}", text), repr(text)
