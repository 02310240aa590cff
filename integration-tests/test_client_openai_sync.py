"""The official `openai` Python SDK, synchronous client: chat and completions, plain and streamed,
greedy, with `logprobs`, `top_logprobs` and `echo`. Every body and chunk the SDK received validates
against OpenAI's schema; the logprobs hold what OpenAI documents (logprob_checks)."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessageParam

import openai_schema
from client_streams import join_chat, join_completion
from logprob_checks import check_chat_logprobs, check_completion_logprobs
from openai_schema import COMPLETION_ECHO
from served import raw_json

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "The sea is"
MAX_TOKENS = 6
# quiver's extension: every generated token is visible text, so the tokens' bytes spell the whole
# content and every request generates MAX_TOKENS.
ALL_TOKENS = {"ignore_eos": True}


def _chat(client: Any, model: str, **options: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=ALL_TOKENS, **options
    )


def _completion(client: Any, model: str, **options: Any) -> Any:
    options.setdefault("max_tokens", MAX_TOKENS)
    return client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, temperature=0, extra_body=ALL_TOKENS, **options
    )


def test_chat(client, llama):
    raw = _chat(client, llama.model)
    openai_schema.validate(raw_json(raw), "CreateChatCompletionResponse")
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS


def test_chat_stream(client, llama):
    stream = client.chat.completions.create(
        model=llama.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=ALL_TOKENS,
    )  # fmt: skip
    joined = join_chat(chunk.to_dict() for chunk in stream)
    assert joined.finish_reasons == ["length"]
    assert joined.usage is not None and joined.usage["completion_tokens"] == MAX_TOKENS
    assert joined.text == raw_json(_chat(client, llama.model))["choices"][0]["message"]["content"]


def test_chat_logprobs(client, llama):
    raw = _chat(client, llama.model, logprobs=True, top_logprobs=3)
    body = raw_json(raw)
    openai_schema.validate(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["logprobs"] is not None, "logprobs: true answered with logprobs: null"
    assert len(choice["logprobs"]["content"]) == MAX_TOKENS
    check_chat_logprobs(choice["logprobs"]["content"], 3, choice["message"]["content"], str(llama.model_dir))
    # The SDK parses the same body into its own types.
    parsed = raw.parse().choices[0].logprobs
    assert parsed is not None and parsed.content is not None
    assert [entry.token for entry in parsed.content] == [entry["token"] for entry in choice["logprobs"]["content"]]


def test_chat_stream_logprobs(client, llama):
    stream = client.chat.completions.create(
        model=llama.model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
        stream=True, extra_body=ALL_TOKENS,
    )  # fmt: skip
    joined = join_chat(chunk.to_dict() for chunk in stream)
    assert len(joined.logprobs) == MAX_TOKENS
    check_chat_logprobs(joined.logprobs, 2, joined.text, str(llama.model_dir))


def test_completion(client, llama):
    raw = _completion(client, llama.model)
    openai_schema.validate(raw_json(raw), "CreateCompletionResponse")
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS


def test_completion_stream(client, llama):
    stream = client.completions.create(
        model=llama.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=ALL_TOKENS
    )
    joined = join_completion(chunk.to_dict() for chunk in stream)
    assert joined.finish_reasons == ["length"]
    assert joined.text == raw_json(_completion(client, llama.model))["choices"][0]["text"]


def test_completion_logprobs(client, llama):
    body = raw_json(_completion(client, llama.model, logprobs=3))
    openai_schema.validate(body, "CreateCompletionResponse")
    choice = body["choices"][0]
    assert choice["logprobs"] is not None, "logprobs: 3 answered with logprobs: null"
    assert len(choice["logprobs"]["tokens"]) == MAX_TOKENS
    check_completion_logprobs(choice["logprobs"], 3, choice["text"])


def test_completion_echo(client, llama):
    body = raw_json(_completion(client, llama.model, echo=True))
    openai_schema.validate(body, "CreateCompletionResponse")
    generated = raw_json(_completion(client, llama.model))["choices"][0]["text"]
    assert body["choices"][0]["text"] == PROMPT + generated
    assert body["choices"][0]["logprobs"] is None


def test_completion_echo_logprobs(client, llama):
    body = raw_json(_completion(client, llama.model, logprobs=2, echo=True))
    openai_schema.validate(body, COMPLETION_ECHO)
    choice, usage = body["choices"][0], body["usage"]
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"] + MAX_TOKENS
    check_completion_logprobs(
        choice["logprobs"], 2, choice["text"], echoed_prompt=PROMPT, prompt_tokens=usage["prompt_tokens"]
    )


def test_completion_echo_without_generating(client, llama):
    """lm-eval's log-likelihood request: `echo` with `max_tokens: 0` scores the prompt only."""
    body = raw_json(_completion(client, llama.model, max_tokens=0, logprobs=1, echo=True))
    openai_schema.validate(body, COMPLETION_ECHO)
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == PROMPT and usage["completion_tokens"] == 0
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"]
    check_completion_logprobs(
        choice["logprobs"], 1, choice["text"], echoed_prompt=PROMPT, prompt_tokens=usage["prompt_tokens"]
    )


def test_completion_stream_logprobs(client, llama):
    stream = client.completions.create(
        model=llama.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2, stream=True,
        extra_body=ALL_TOKENS,
    )  # fmt: skip
    joined = join_completion(chunk.to_dict() for chunk in stream)
    assert len(joined.logprobs["tokens"]) == MAX_TOKENS
    check_completion_logprobs(joined.logprobs, 2, joined.text)
