"""Reasoning output through the whole stack, with the official openai SDK, on thinking parrots
whose replies are known in advance (thinking_models): the reasoning/content split is checked
against the known reply cut at the template's markers (vLLM's rule: text between the markers is
`reasoning_content`, text after `</think>` is `content`, both as written), plain and streamed,
with every generated token reported once; `chat_template_kwargs={"enable_thinking": False}`
renders exactly the prompt transformers' `apply_chat_template(..., enable_thinking=False)` makes
with Qwen3's template; DeepSeek-R1's template, which opens the thinking block in the prompt;
an adapter with a template of its own without thinking markers, and `--reasoning-parser none`,
answer with no `reasoning_content` at all.

Structured output and forced tool calls after the thinking block: test_reasoning_structured.py.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from served import RETURN_TOKEN_IDS, prompt_token_ids, raw_json, stream_token_ids, token_ids
from thinking_models import (
    ANSWER,
    PLAIN_TEMPLATE_ADAPTER,
    QWEN3_REPLY,
    R1_REPLY,
    REASONING,
    THINK_END,
    THINK_START,
    reasoning_of,
    split_at_markers,
    start_parrot,
)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Should I?"}]
MAX_TOKENS = 40


@pytest.fixture
def qwen3(qwen3_parrot):
    return qwen3_parrot.model_dir, qwen3_parrot.stack


@pytest.fixture
def r1(r1_parrot):
    return r1_parrot.model_dir, r1_parrot.stack


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client, model: str, max_tokens: int = MAX_TOKENS, **kwargs) -> dict[str, Any]:
    """A streamed chat, joined: reasoning and content pieces, token ids and logprob entries in
    chunk order, and the finish reason."""
    out: dict[str, Any] = {"reasoning": [], "content": [], "ids": [], "logprobs": [], "finish": None, "order": [],
                           "usage": None}
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens,
                                                stream=True, stream_options={"include_usage": True}, **kwargs):
        out["usage"] = chunk.usage or out["usage"]
        for choice in chunk.choices:
            reasoning = reasoning_of(choice.delta)
            if reasoning is not None:
                out["reasoning"].append(reasoning)
                out["order"].append("reasoning")
            if choice.delta.content:
                out["content"].append(choice.delta.content)
                out["order"].append("content")
            out["ids"] += stream_token_ids(choice)
            if choice.logprobs and choice.logprobs.content:
                out["logprobs"] += [entry.logprob for entry in choice.logprobs.content]
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def _reference_text(tokenizer: Any, **kwargs: Any) -> str:
    """transformers' rendering of MESSAGES with the generation prompt (kwargs: template
    variables, as `apply_chat_template` takes them)."""
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(text, str)
    return text


def _reference_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _thinking_tokens(model_dir, reply: str, prompt_opened: bool) -> int:
    """transformers' count of the reply's tokens up to and including `</think>` (the thinking
    block, markers included): what `reasoning_tokens` reports."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    thinking = reply[: reply.index(THINK_END) + len(THINK_END)]
    assert prompt_opened != thinking.lstrip().startswith(THINK_START)
    return len(tokenizer(thinking, add_special_tokens=False)["input_ids"])


def _reasoning_tokens(usage: Any) -> int:
    assert usage is not None and usage.completion_tokens_details is not None
    return int(usage.completion_tokens_details.reasoning_tokens)


def _expected_ids(model_dir, reply: str) -> list[int]:
    """The reply's tokens as the parrot writes them (its chain), then EOS."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_qwen3_reasoning_is_split_from_the_content(qwen3):
    model_dir, stack = qwen3
    reasoning, content = split_at_markers(QWEN3_REPLY, prompt_opened=False)
    assert (reasoning, content) == (REASONING, "\n\n" + ANSWER)
    with _client(stack) as client:
        response = client.chat.completions.create(model="qwen3-parrot", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  logprobs=True, extra_body=RETURN_TOKEN_IDS)
        streamed = _stream(client, "qwen3-parrot", logprobs=True, extra_body=RETURN_TOKEN_IDS)
    message = response.choices[0].message
    assert reasoning_of(message) == reasoning
    assert message.content == content
    assert response.choices[0].finish_reason == "stop"
    # Streamed: the same split, all reasoning before any content, no marker on either side.
    assert "".join(streamed["reasoning"]) == reasoning
    assert "".join(streamed["content"]) == content
    assert streamed["order"] == sorted(streamed["order"], key=["reasoning", "content"].index)
    assert not any(marker in piece for marker in (THINK_START, THINK_END)
                   for piece in streamed["reasoning"] + streamed["content"])
    assert streamed["finish"] == "stop"
    # Every generated token once, in order, with its logprob, plain and streamed.
    expected_ids = _expected_ids(model_dir, QWEN3_REPLY)
    assert token_ids(response) == expected_ids
    assert streamed["ids"] == expected_ids
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == len(expected_ids)
    assert len(streamed["logprobs"]) == len(expected_ids)
    assert response.usage is not None and response.usage.completion_tokens == len(expected_ids)
    # The thinking block's tokens, `<think>` to `</think>`, plain and streamed.
    thinking = _thinking_tokens(model_dir, QWEN3_REPLY, prompt_opened=False)
    assert 0 < thinking < len(expected_ids)
    assert _reasoning_tokens(response.usage) == _reasoning_tokens(streamed["usage"]) == thinking
    # The Responses API reports the same count in its own field.
    with _client(stack) as client:
        answered = client.responses.create(model="qwen3-parrot", input="Should I?", max_output_tokens=MAX_TOKENS)
    assert answered.usage is not None
    assert answered.usage.output_tokens == len(expected_ids)
    assert answered.usage.output_tokens_details.reasoning_tokens == thinking


def test_enable_thinking_false_renders_as_transformers_and_answers_in_content(qwen3):
    model_dir, stack = qwen3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def reference_prompt(**kwargs) -> list[int]:
        return _reference_ids(tokenizer, _reference_text(tokenizer, **kwargs))

    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    with _client(stack) as client:
        off = client.chat.completions.create(model="qwen3-parrot", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                             extra_body={**RETURN_TOKEN_IDS, **kwargs})
        on = client.chat.completions.create(model="qwen3-parrot", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                            extra_body=RETURN_TOKEN_IDS)
        streamed = _stream(client, "qwen3-parrot", extra_body=kwargs)
        raw = client.chat.completions.with_raw_response.create(model="qwen3-parrot", messages=MESSAGES,
                                                               max_tokens=MAX_TOKENS, extra_body=kwargs)
    assert prompt_token_ids(off) == reference_prompt(enable_thinking=False)
    assert prompt_token_ids(on) == reference_prompt()
    assert prompt_token_ids(off) != prompt_token_ids(on)
    # The prompt closed the thinking block: the parrot answers at once, all content.
    assert off.choices[0].message.content == ANSWER
    assert reasoning_of(off.choices[0].message) is None
    assert "".join(streamed["content"]) == ANSWER and streamed["reasoning"] == []
    # A field with an effect: not named among the ignored ones.
    assert "chat_template_kwargs" not in raw.headers.get("quiver-ignored-fields", "")
    assert raw_json(raw)["choices"][0]["message"]["reasoning_content"] is None


def test_chat_template_kwargs_cannot_replace_the_requests_own_variables(qwen3):
    _, stack = qwen3
    with _client(stack) as client:
        for name in ["messages", "add_generation_prompt", "chat_template"]:
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model="qwen3-parrot", messages=MESSAGES, max_tokens=4,
                                               extra_body={"chat_template_kwargs": {name: []}})
            assert error.value.param == f"chat_template_kwargs.{name}"


def test_thinking_cut_short_is_all_reasoning(qwen3):
    model_dir, stack = qwen3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(QWEN3_REPLY, add_special_tokens=False)["input_ids"]
    cut = 4  # <think> and three tokens of the reasoning
    assert THINK_END not in tokenizer.decode(ids[:cut])
    with _client(stack) as client:
        response = client.chat.completions.create(model="qwen3-parrot", messages=MESSAGES, max_tokens=cut)
        streamed = _stream(client, "qwen3-parrot", max_tokens=cut)
    reasoning, content = split_at_markers(str(tokenizer.decode(ids[:cut])), prompt_opened=False)
    assert content is None
    assert reasoning_of(response.choices[0].message) == reasoning
    assert response.choices[0].message.content is None
    assert response.choices[0].finish_reason == "length"
    assert "".join(streamed["reasoning"]) == reasoning
    assert streamed["content"] == [] and streamed["finish"] == "length"
    # Cut inside the block: every generated token is thinking.
    assert _reasoning_tokens(response.usage) == _reasoning_tokens(streamed["usage"]) == cut


def test_r1_template_opens_the_block_in_the_prompt(r1):
    model_dir, stack = r1
    reasoning, content = split_at_markers(R1_REPLY, prompt_opened=True)
    assert (reasoning, content) == (REASONING, "\n\n" + ANSWER)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = _reference_text(tokenizer)
    assert prompt.endswith(f"{THINK_START}\n"), "R1's template opens the thinking block"
    code, info = stack.get("/info")
    assert code == 200 and json.loads(info)["reasoning_parser"] == "deepseek_r1"
    with _client(stack) as client:
        response = client.chat.completions.create(model="r1-parrot", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  extra_body=RETURN_TOKEN_IDS)
        streamed = _stream(client, "r1-parrot", extra_body=RETURN_TOKEN_IDS)
    assert prompt_token_ids(response) == _reference_ids(tokenizer, prompt)
    assert reasoning_of(response.choices[0].message) == reasoning
    assert response.choices[0].message.content == content
    assert "".join(streamed["reasoning"]) == reasoning
    assert "".join(streamed["content"]) == content
    assert streamed["ids"] == token_ids(response) == _expected_ids(model_dir, R1_REPLY)
    # The prompt opened the block: the reply thinks from its first token to `</think>`.
    thinking = _thinking_tokens(model_dir, R1_REPLY, prompt_opened=True)
    assert _reasoning_tokens(response.usage) == _reasoning_tokens(streamed["usage"]) == thinking


def test_a_template_without_thinking_markers_gets_no_reasoning_field(qwen3):
    """The adapter's own ChatML template shows no markers: no parser for it, on a server whose
    base model has one; its replies (the base's, the adapter being untrained) are all content."""
    _, stack = qwen3
    with _client(stack) as client:
        raw = client.chat.completions.with_raw_response.create(model=PLAIN_TEMPLATE_ADAPTER, messages=MESSAGES,
                                                               max_tokens=MAX_TOKENS)
        deltas = [choice.delta for chunk in client.chat.completions.create(
            model=PLAIN_TEMPLATE_ADAPTER, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True)
            for choice in chunk.choices]
    message = raw_json(raw)["choices"][0]["message"]
    assert message["content"] == QWEN3_REPLY
    assert "reasoning_content" not in message
    assert "".join(delta.content or "" for delta in deltas) == QWEN3_REPLY
    assert all("reasoning_content" not in (delta.model_extra or {}) for delta in deltas)


def test_reasoning_parser_none_turns_the_split_off(qwen3, tmp_path):
    model_dir, _ = qwen3
    stack = start_parrot(model_dir, tmp_path / "none.log", "qwen3-parrot", ["--reasoning-parser", "none"])
    try:
        code, body = stack.get("/info")
        with _client(stack) as client:
            raw = client.chat.completions.with_raw_response.create(model="qwen3-parrot", messages=MESSAGES,
                                                                   max_tokens=MAX_TOKENS)
    finally:
        stack.stop()
    assert code == 200 and json.loads(body)["reasoning_parser"] is None
    message = raw_json(raw)["choices"][0]["message"]
    assert message["content"] == QWEN3_REPLY
    assert "reasoning_content" not in message
