"""What one hostile client can hold or make the router hold (issue 48), on the real stack.

- Slow bodies: a flood of connections that each send their headers and half a body, more of them
  than `--max-connections`, once held every slot for minutes and made `/health` time out. Each
  is now answered 408 (OpenAI's error, `Connection: close`) and closed once
  `--body-read-timeout-secs` has passed; `/health` and a completion sent behind the flood are
  answered, and the router holds no more sockets afterwards than before.
- Echo + logprobs amplification: a 77 KB completions request (64 prompts of 400 token ids,
  `n: 8`, `echo`, `logprobs: 5`, `max_tokens: 100`) once came back as 32 MB. It is refused up
  front with 400 `logprob_entries_exceeded`, which states the product, while an lm-eval style
  loglikelihood request (the longest prompt the server takes, echoed with `logprobs: 5`) is
  served under the same default. What a large answer built is given back to the system before
  it goes out: the router once kept its peak resident after every such answer.

One stack serves the module; the flood's clients are raw sockets.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import openai_schema
from conftest import SHARD_ENV
from stack import Stack, StackConfig

SERVED_NAME = "tiny"
MAX_CONNECTIONS = 256
FLOOD = 320
BODY_READ_TIMEOUT_S = 2
MAX_TOTAL_TOKENS = 1024
# What the router may keep resident after a 4.6 MB logprobs answer; glibc's arenas once kept the
# 32 MB that building it took.
KEPT_AFTER_LARGE_ANSWER = 12 << 20
# Only so that a server that never sheds the flood fails the test instead of hanging it.
CLIENT_TIMEOUT_S = 60
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stack(pool, tmp_path_factory) -> Iterator[Stack]:
    config = StackConfig(
        model_id=str(pool.model_dir("llama")),
        served_model_name=SERVED_NAME,
        max_total_tokens=MAX_TOTAL_TOKENS,
        # A KV cache that takes the amplifying request below, so that only its logprobs refuse it.
        cpu_kv_cache_gib=0.5,
        # Through the variables: a build without the body timeout still starts, and the flood
        # shows what it lacks.
        extra_env={
            **SHARD_ENV,
            "QUIVER_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "QUIVER_BODY_READ_TIMEOUT_SECS": str(BODY_READ_TIMEOUT_S),
        },
    )
    running = Stack(config, tmp_path_factory.mktemp("resource-bounds") / "stack.log")
    running.start(timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield running
    finally:
        running.stop()


def _router_pid(stack: Stack) -> int:
    [pid] = [pid for pid, command in stack.descendants() if "quiver-router" in command]
    return pid


def _router_resident_bytes(stack: Stack) -> int:
    with open(f"/proc/{_router_pid(stack)}/status") as status:
        [kib] = [line.split()[1] for line in status if line.startswith("VmRSS:")]
    return int(kib) << 10


def _router_sockets(stack: Stack) -> int:
    fd_dir = f"/proc/{_router_pid(stack)}/fd"
    return sum(os.readlink(f"{fd_dir}/{fd}").startswith("socket:") for fd in os.listdir(fd_dir))


def _send(stack: Stack, request: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=CLIENT_TIMEOUT_S)
    sock.sendall(request)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout fails
    the test if it never does)."""
    received = b""
    with sock:
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _status_and_body(answer: bytes) -> tuple[int, str, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, head.decode("latin-1").lower(), body


def _post(path: str, body: dict, extra: bytes = b"", cut: bool = False) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: quiver\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n").encode() + extra + b"\r\n"
    return head + (payload[: len(payload) // 2] if cut else payload)


def test_a_slow_body_flood_is_shed_and_the_server_keeps_answering(stack):
    completion = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}
    baseline = _router_sockets(stack)
    flood = [_send(stack, _post("/v1/completions", completion, cut=True)) for _ in range(FLOOD)]
    # Behind the flood in the listen backlog: answered once the server has shed enough of it.
    close = b"Connection: close\r\n"
    health = _send(stack, b"GET /health HTTP/1.1\r\nHost: quiver\r\n" + close + b"\r\n")
    served = _send(stack, _post("/v1/completions", completion, extra=close))
    try:
        health_answer = _until_closed(health)
        completion_answer = _until_closed(served)
        with ThreadPoolExecutor(max_workers=32) as pool:
            shed = list(pool.map(_until_closed, flood))
    finally:
        for sock in flood:
            sock.close()

    status, _, body = _status_and_body(health_answer)
    assert status == 200, health_answer
    status, _, body = _status_and_body(completion_answer)
    assert status == 200, completion_answer
    assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    for answer in shed:
        status, head, body = _status_and_body(answer)
        assert status == 408, answer
        assert "connection: close" in head, head
        error = json.loads(body)
        openai_schema.validate(error, "ErrorResponse")
        assert error["error"]["code"] == "request_timeout", error
    # The server closed every one of those connections itself before its client read the end:
    # none is left open on its side.
    assert _router_sockets(stack) <= baseline


def _completion(stack: Stack, body: dict) -> tuple[int, dict]:
    return stack.post_json("/v1/completions", body, timeout=CLIENT_TIMEOUT_S)


def test_what_a_large_answer_built_is_given_back(stack):
    """An answer just under the logprob cap (64 prompts of 400 ids echoed with `logprobs: 5` and
    250 generated tokens each: 249,600 entries, 4.6 MB) builds tens of MB of entries. The old
    router kept them resident (+32 MB after the first such answer, growing with the next ones);
    now they go back to the system before the answer goes out."""
    before = _router_resident_bytes(stack)
    status, answer = _completion(stack, {"model": SERVED_NAME, "prompt": [[5] * 400] * 64, "echo": True,
                                         "logprobs": 5, "max_tokens": 250, "ignore_eos": True})
    assert status == 200, answer
    assert len(answer["choices"]) == 64
    kept = _router_resident_bytes(stack) - before
    assert kept < KEPT_AFTER_LARGE_ANSWER, f"the router kept {kept >> 20} MiB"


def test_echo_and_logprobs_amplification_is_refused_up_front(stack):
    hostile = {"model": SERVED_NAME, "prompt": [[5] * 400] * 64, "n": 8, "echo": True, "logprobs": 5,
               "max_tokens": 100, "ignore_eos": True}
    assert len(json.dumps(hostile)) < 80_000
    status, answer = _completion(stack, hostile)
    assert status == 400, answer
    openai_schema.validate(answer, "ErrorResponse")
    error = answer["error"]
    assert (error["code"], error["param"]) == ("logprob_entries_exceeded", "logprobs"), error
    # 512 choices × (400 echoed + 100 generated positions) × (5 alternatives + 1).
    assert "1536000 logprob entries" in error["message"], error
    assert "(204800 prompt tokens + 51200 max_tokens, over 512 choices) × (5 alternatives + 1)" in error["message"]
    assert "--max-logprob-entries" in error["message"], error


def test_a_loglikelihood_request_of_the_whole_context_is_served(stack):
    """lm-eval's loglikelihood request: one prompt as long as the server takes, echoed with
    `logprobs: 5` and `max_tokens: 0` (its prompt's logprobs only)."""
    longest = MAX_TOTAL_TOKENS - 1
    status, answer = _completion(stack, {"model": SERVED_NAME, "prompt": [7] * longest, "echo": True,
                                         "logprobs": 5, "max_tokens": 0})
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == longest
    # The 5 alternatives, and the token itself where it is not among them.
    assert all(5 <= len(top) <= 6 for top in logprobs["top_logprobs"][1:])

