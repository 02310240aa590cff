"""langchain-openai's `ChatOpenAI` (pinned in pyproject's `test` extra) pointed at the stack:
`invoke` and `stream`, plain and with `logprobs=True` (langchain puts them in
`response_metadata["logprobs"]`)."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest
import tiktoken
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from logprob_checks import check_chat_logprobs

QUESTION = "What is a river?"
MAX_TOKENS = 6
ALL_TOKENS = {"ignore_eos": True}


@pytest.fixture(autouse=True)
def no_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken fetches its encodings from the network on first use; none is reachable here, and
    nothing ChatOpenAI does for a chat call may need one."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError(f"ChatOpenAI asked tiktoken for an encoding: {args} {kwargs}")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


def _chat(served: Any, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=served.stack.base_url + "/v1",
        api_key=SecretStr("unused"),
        model=served.model,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        extra_body=ALL_TOKENS,
        **options,  # type: ignore[call-arg]
    )


def test_invoke(llama):
    message = _chat(llama).invoke(QUESTION)
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["model_name"] == llama.model
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] == MAX_TOKENS


def test_stream_equals_invoke(llama):
    chat = _chat(llama)
    chunks = list(chat.stream(QUESTION))
    assert all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert "".join(str(chunk.content) for chunk in chunks) == chat.invoke(QUESTION).content


def test_invoke_logprobs(llama):
    message = _chat(llama, logprobs=True, top_logprobs=2).invoke(QUESTION)
    logprobs = message.response_metadata.get("logprobs")
    assert logprobs is not None, f"no logprobs in response_metadata: {message.response_metadata}"
    assert len(logprobs["content"]) == MAX_TOKENS
    check_chat_logprobs(logprobs["content"], 2, str(message.content), str(llama.model_dir))


def test_stream_logprobs(llama):
    text, entries = "", list[dict[str, Any]]()
    for chunk in _chat(llama, logprobs=True, top_logprobs=2).stream(QUESTION):
        text += str(chunk.content)
        entries += (chunk.response_metadata.get("logprobs") or {}).get("content") or []
    assert len(entries) == MAX_TOKENS
    check_chat_logprobs(entries, 2, text, str(llama.model_dir))
