"""Tool calling through the whole stack on random-weight models, where only the grammar can make a
call valid: `tool_choice: "required"` and a named function always produce `tool_calls` whose
`arguments` parse and validate (jsonschema) against the called tool's `parameters`, with
finish_reason "tool_calls" and `content` null; on the base model and both adapters, plain and
streamed; `parallel_tool_calls: false` gives exactly one call; streamed tool-call deltas follow
OpenAI's shape (first delta of a call: index, id, type, function.name, arguments "";
then index + argument pieces) and reassemble to the plain call made with the same seed;
`tool_choice: "none"` gives text; `auto` gives text or valid calls; legacy
`functions`/`function_call` force a call too. Every body and chunk validates against OpenAI's
schema.

A multi-turn tool conversation sent over HTTP renders to exactly the tokens transformers'
apply_chat_template makes with Hermes 2 Pro's and Llama 3.1's templates (carried by two adapters).
The renderer itself is checked byte for byte by router/tests/chat_template_golden.rs (golden.json's
`tool_call_roundtrip` cases: Hermes 2 Pro, Qwen 2.5, Qwen 3, Llama 3.1)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from transformers import AutoTokenizer

import openai_schema
from structured_checks import (
    CHAT,
    MODELS,
    TEMPLATE_ADAPTERS,
    chat_template,
    post,
    start_structured_stack,
    stream_chat,
    structured_set,
    validate,
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two small numbers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Finds a record.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["id"], "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["new", "old"]}}}}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MAX_TOKENS = 400
# <|im_end|>, the EOS of every model here (model_builders; the adapters' tokenizers keep its id).
EOS_ID = 2
TOOL_CHAT = CHAT + [{"role": "user", "content": "Use a tool."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    eos = AutoTokenizer.from_pretrained(structured_set(tmp_path_factory).base_dir).eos_token_id
    assert eos == EOS_ID, f"the models' EOS is {eos}, not {EOS_ID}"
    stack = start_structured_stack(tmp_path_factory, "tool-calls")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return structured_set(tmp_path_factory).base_dir


# The forced-call tests run on the base, both adapters of MODELS, and the adapters whose templates
# read `tools` (Hermes and Llama 3.1 families).
CALLING_MODELS = MODELS + list(TEMPLATE_ADAPTERS)


def body(model: str, tool_choice: Any, **extra: Any) -> dict[str, Any]:
    request = {"model": model, "messages": TOOL_CHAT, "tools": TOOLS, "tool_choice": tool_choice,
               "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if tool_choice == "required" and request.get("parallel_tool_calls", True):
        # `required` with parallel calls allows any number of calls: after each, a random model
        # may as well start another until max_tokens. The grammar allows EOS only after a whole
        # call, so favouring it ends the reply after its first complete call(s) without making
        # anything valid that was not.
        request["logit_bias"] = {str(EOS_ID): 30}
    return request


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def check_calls(calls: list[dict[str, Any]], only: str | None = None) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of each call, checked against the declared tools."""
    assert calls, "no tool_calls"
    parsed = []
    for call in calls:
        assert call["type"] == "function", call
        assert call["id"], call
        name = call["function"]["name"]
        assert name in PARAMETERS, f"undeclared tool {name!r}"
        if only is not None:
            assert name == only, call
        parsed.append((name, validate(PARAMETERS[name], call["function"]["arguments"])))
    assert len({call["id"] for call in calls}) == len(calls), "tool call ids repeat"
    return parsed


def check_plain(response: dict[str, Any], only: str | None = None) -> list[tuple[str, Any]]:
    openai_schema.validate(response, "CreateChatCompletionResponse")
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None, choice["message"]
    return check_calls(choice["message"]["tool_calls"], only)


def reassemble(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The calls a stream's tool-call deltas spell, its text, and its finish reasons; checks that
    each call's first delta carries id, type and name with empty arguments, and later ones only
    the index and argument pieces."""
    calls: dict[int, dict[str, Any]] = {}
    text, finish_reasons = "", []
    for chunk in chunks:
        openai_schema.validate(chunk, "CreateChatCompletionStreamResponse")
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                index = piece["index"]
                if index not in calls:
                    assert piece.get("id") and piece.get("type") == "function", piece
                    assert piece["function"]["name"] and piece["function"].get("arguments", "") == "", piece
                    calls[index] = {"id": piece["id"], "type": "function",
                                    "function": {"name": piece["function"]["name"], "arguments": ""}}
                else:
                    assert not piece.get("id") and not (piece.get("function") or {}).get("name"), piece
                    calls[index]["function"]["arguments"] += piece["function"]["arguments"]
            if choice.get("finish_reason"):
                finish_reasons.append(choice["finish_reason"])
    assert sorted(calls) == list(range(len(calls))), f"tool call indexes {sorted(calls)}"
    return [calls[i] for i in sorted(calls)], text, finish_reasons


CHOICES: list[tuple[str, Any, str | None]] = [("required", "required", None)] + [
    (name, named(name), name) for name in PARAMETERS
]


@pytest.fixture(scope="module")
def forced(stack) -> dict[tuple[str, str, bool], Any]:
    """Every forcing tool_choice on every model, plain and streamed, issued concurrently."""
    def run(model, choice, streamed):
        if streamed:
            return reassemble(stream_chat(stack, body(model, choice)))
        return post(stack, "/v1/chat/completions", body(model, choice))

    with ThreadPoolExecutor(max_workers=24) as pool:
        futures = {(label, model, streamed): pool.submit(run, model, choice, streamed)
                   for label, choice, _ in CHOICES for model in CALLING_MODELS for streamed in (False, True)}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("model", CALLING_MODELS)
@pytest.mark.parametrize(("label", "only"), [(label, only) for label, _, only in CHOICES], ids=[c[0] for c in CHOICES])
def test_forced_calls_validate(forced, label, only, model):
    plain = check_plain(forced[(label, model, False)], only)
    calls, text, finish_reasons = forced[(label, model, True)]
    assert text == "", f"streamed content beside forced calls: {text!r}"
    assert finish_reasons == ["tool_calls"], finish_reasons
    # Greedy: the stream's calls are the plain response's.
    assert check_calls(calls, only) == plain


@pytest.mark.parametrize("tool_choice", ["required", named("add")], ids=["required", "named"])
def test_sampled_stream_reassembles_to_plain_call(stack, tool_choice):
    """Sampled with a seed, the streamed deltas spell the same calls as the plain response."""
    request = body(MODELS[1], tool_choice, temperature=1.0, seed=31)
    plain = check_plain(post(stack, "/v1/chat/completions", request))
    calls, _, finish_reasons = reassemble(stream_chat(stack, request))
    assert finish_reasons == ["tool_calls"]
    assert check_calls(calls) == plain


@pytest.mark.parametrize("model", MODELS)
def test_parallel_tool_calls_false_gives_one_call(stack, model):
    with ThreadPoolExecutor(max_workers=3) as pool:
        responses = [pool.submit(post, stack, "/v1/chat/completions",
                                 body(model, "required", parallel_tool_calls=False, temperature=1.0, seed=seed))
                     for seed in (1, 2, 3)]
        for future in responses:
            assert len(check_plain(future.result())) == 1


@pytest.mark.parametrize("model", MODELS)
def test_calls_cut_by_max_tokens_still_come_back_as_calls(stack, model):
    """`required` with parallel calls and EOS banned: the model writes calls until max_tokens
    cuts one. The reply still comes back as calls, as OpenAI's does: the complete ones whole
    (they validate), the cut one with the arguments written so far, finish_reason "length", and
    no markup as content; streamed, the deltas spell the same calls."""
    request = body(model, "required", max_tokens=120)
    request["logit_bias"] = {str(EOS_ID): -100}
    response = post(stack, "/v1/chat/completions", request)
    openai_schema.validate(response, "CreateChatCompletionResponse")
    choice = response["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"] is None, choice["message"]
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 2, f"120 tokens hold more than one call of these tools: {calls}"
    check_calls(calls[:-1])
    last = calls[-1]["function"]
    assert last["name"] in PARAMETERS and isinstance(last["arguments"], str), last
    streamed, text, finish_reasons = reassemble(stream_chat(stack, request))
    assert (text, finish_reasons) == ("", ["length"])
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_n_choices_all_call(stack):
    response = post(stack, "/v1/chat/completions", body(MODELS[0], "required", n=3, temperature=1.0, seed=5))
    assert len(response["choices"]) == 3
    for choice in response["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"])


def test_tool_choice_none_gives_text(stack):
    response = post(stack, "/v1/chat/completions", body(MODELS[0], "none", max_tokens=16))
    openai_schema.validate(response, "CreateChatCompletionResponse")
    choice = response["choices"][0]
    assert not choice["message"].get("tool_calls"), choice
    assert choice["finish_reason"] in ("stop", "length"), choice
    assert isinstance(choice["message"]["content"], str)


@pytest.mark.parametrize("model", MODELS)
def test_auto_gives_text_or_valid_calls(stack, model):
    response = post(stack, "/v1/chat/completions", body(model, "auto", max_tokens=40))
    openai_schema.validate(response, "CreateChatCompletionResponse")
    choice = response["choices"][0]
    if choice["message"].get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"])
    else:
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert isinstance(choice["message"]["content"], str)


def test_legacy_function_call(stack):
    """`functions` + `function_call: {"name"}` force a call of that function. The contract maps
    them onto the tools path; the answer may use either shape OpenAI has had (tool_calls, or the
    legacy message.function_call)."""
    request = {"model": MODELS[0], "messages": TOOL_CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
               "functions": [tool["function"] for tool in TOOLS], "function_call": {"name": "lookup"}}
    message = post(stack, "/v1/chat/completions", request)["choices"][0]["message"]
    if message.get("tool_calls"):
        check_calls(message["tool_calls"], "lookup")
    else:
        call = message.get("function_call")
        assert call and call["name"] == "lookup", message
        validate(PARAMETERS["lookup"], call["arguments"])


# A conversation with an assistant's call (arguments a JSON string, as OpenAI sends them) and the
# tool's result.
HISTORY: list[dict[str, Any]] = TOOL_CHAT + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}}]},
    # Hermes 2 Pro's template reads the tool's name from its result message.
    {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "3"},
]


@pytest.mark.parametrize("adapter", list(TEMPLATE_ADAPTERS))
def test_multi_turn_tool_conversation_renders_like_transformers(stack, base_dir, adapter):
    """The prompt the server tokenized for a tool conversation is exactly transformers'
    apply_chat_template of the same messages and tools with the adapter's template; the forced
    call that follows validates."""
    response = post(stack, "/v1/chat/completions",
                    {**body(adapter, named("get_weather")), "messages": HISTORY, "return_token_ids": True})
    check_plain(response, "get_weather")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rendered = tokenizer.apply_chat_template(HISTORY, tools=list[Any](TOOLS), chat_template=chat_template(adapter),
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    want = list(cast(list[int], rendered))
    assert "get_weather" in tokenizer.decode(want) and "call" in tokenizer.decode(want)
    assert response["prompt_token_ids"] == want
