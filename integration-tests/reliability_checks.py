"""What every reliability scenario asserts: an answer that is never 5xx and always OpenAI-shaped,
a router whose gauges show every resource back, and a server that still gives the transformers
reference's greedy tokens."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai_schema
import reference
from openai_schema import COMPLETION_CHUNK
from reliability_soak import TALLY
from served import RETURN_TOKEN_IDS
from stack import Stack

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_RESPONSE_SCHEMA = {CHAT_PATH: "CreateChatCompletionResponse", COMPLETIONS_PATH: "CreateCompletionResponse"}
_CHUNK_SCHEMA = {CHAT_PATH: "CreateChatCompletionStreamResponse", COMPLETIONS_PATH: COMPLETION_CHUNK}
# A guard against a hang, not a timing assertion: generous for a loaded 2-core box.
REQUEST_TIMEOUT_S = 120.0
# docs/security.md: every error message is bounded to this many bytes.
MAX_MESSAGE_BYTES = 512


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


def send(stack: Stack, path: str, body: bytes, content_type: str | None = "application/json") -> Answer:
    """POSTs the bytes as they are (no SDK: it would refuse to send most of the corpus) and
    records the outcome in the soak tally."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    request = urllib.request.Request(stack.base_url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            answer = Answer(response.status, response.headers.get("Content-Type", ""), response.read())
    except urllib.error.HTTPError as err:
        answer = Answer(err.code, err.headers.get("Content-Type", ""), err.read())
    TALLY.record(answer.status)
    return answer


def assert_error_shape(body: object, context: str) -> None:
    """OpenAI's error object: the published schema, plus the four fields the SDKs read (the
    schema lets `param` and `code` be absent; OpenAI always sends them, null or not)."""
    openai_schema.validate(body, "ErrorResponse")
    assert isinstance(body, dict)
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], f"{context}: {body}"
    assert isinstance(error["type"], str) and error["type"], f"{context}: {body}"
    assert "param" in error and "code" in error, f"{context}: {body}"
    # docs/security.md: a message never echoes unbounded input.
    size = len(error["message"].encode())
    assert size <= MAX_MESSAGE_BYTES, f"{context}: a {size}-byte message: {error['message'][:300]}"


def sse_payloads(body: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order ([DONE] included); comments skipped."""
    return [line[len("data:"):].strip() for line in body.decode().splitlines() if line.startswith("data:")]


def _assert_stream(path: str, body: bytes, context: str) -> None:
    events = sse_payloads(body)
    assert events and events[-1] == "[DONE]", f"{context}: a stream ends with data: [DONE]: {events[-3:]}"
    assert events.count("[DONE]") == 1, context
    chunks = [json.loads(event) for event in events[:-1]]
    for i, chunk in enumerate(chunks):
        if "error" in chunk:
            # An error after the stream started is its last event before [DONE].
            assert i == len(chunks) - 1, f"{context}: events after an error: {chunks[i:]}"
            assert_error_shape(chunk, context)
        else:
            openai_schema.validate(chunk, _CHUNK_SCHEMA[path])


def assert_openai_answer(path: str, answer: Answer, context: str) -> None:
    """Never 5xx; an error is OpenAI's error object; a success is OpenAI's response (or stream)."""
    assert answer.status < 500, f"{context}: {answer.status} {answer.body[:500]!r}"
    if answer.status >= 300:
        assert answer.content_type.startswith("application/json"), f"{context}: {answer.content_type}"
        assert_error_shape(json.loads(answer.body), context)
    elif answer.content_type.startswith("text/event-stream"):
        _assert_stream(path, answer.body, context)
    else:
        openai_schema.validate(json.loads(answer.body), _RESPONSE_SCHEMA[path])


def wait_idle(stack: Stack, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrapes /metrics until every KV block is free and nothing runs or waits; that scrape.

    Each scrape is a round trip to the router, which paces the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = stack.metrics()
        free, total = metrics["quiver_kv_blocks_free"], metrics["quiver_kv_blocks_total"]
        running, waiting = metrics["quiver_requests_running"], metrics["quiver_requests_waiting"]
        if total > 0 and free == total and running == 0 and waiting == 0:
            return metrics
        assert time.monotonic() < deadline, (
            f"not idle after {timeout_s:.0f}s: {free}/{total} KV blocks free, {running} running, "
            f"{waiting} waiting\n--- stack log tail ---\n{stack.log()[-3000:]}"
        )


# The fixed prompt of the after-check; the reference decides how it ends (EOS or length).
CHECK_PROMPT = "The quick brown fox"
CHECK_TOKENS = 16


def assert_base_matches_reference(stack: Stack, model: str, model_dir: str) -> None:
    """A greedy completion equals transformers' on the same weights, token for token."""
    payload = {"model": model, "prompt": CHECK_PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0,
               **RETURN_TOKEN_IDS}
    answer = send(stack, COMPLETIONS_PATH, json.dumps(payload).encode())
    assert answer.status == 200, answer
    body = json.loads(answer.body)
    served = body["choices"][0]["token_ids"]
    prompt_ids = reference.completion_prompt_ids(model_dir, CHECK_PROMPT)
    reference.assert_greedy_parity(served, reference.greedy(model_dir, prompt_ids, CHECK_TOKENS),
                                   "greedy check after the hostile traffic")

