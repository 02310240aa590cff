"""Failure and shutdown edges of issue 12, each test on its own stack: a killed shard is
answered with 503 `shard_unavailable` (never a 500) until the launcher takes the stack down, and
a grace period that runs out ends each request with an error the client can read (an SSE error
event and `[DONE]`, or a 503 body) and a non-zero exit code."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import openai_schema
from conftest import SHARD_ENV
from stack import Stack, StackConfig, parse_prometheus

PROMPT = "Once upon a time"
# Shards load slowly on a shared 2-core box.
STARTUP_TIMEOUT_S = 240


def _own_stack(pool, tmp_path, name: str, **config) -> Stack:
    cfg = StackConfig(model_id=str(pool.model_dir("llama")), served_model_name="tiny",
                      max_total_tokens=1024, extra_env=SHARD_ENV, **config)
    return Stack(cfg, tmp_path / f"{name}.log").start(timeout_s=STARTUP_TIMEOUT_S)


def _post(stack: Stack, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _sse_data(response: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of an SSE response, until the server ends it."""
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


def test_a_killed_shard_gets_503_shard_unavailable_never_500(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "shard-killed")
    statuses: list[tuple[int, bytes]] = []
    stop = threading.Event()
    answered = threading.Semaphore(0)

    def client() -> None:
        # Requests back to back, so some are in flight when the shard dies and some arrive
        # after; until the router's listener is gone.
        while not stop.is_set():
            try:
                statuses.append(_post(stack, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8},
                                      timeout=30))
                answered.release()
            except OSError:
                return

    try:
        shards = [pid for pid, cmd in stack.descendants()
                  if "quiver-server" in cmd or "quiver_server" in cmd]
        assert shards, f"no shard under the launcher: {stack.descendants()}"
        clients = [threading.Thread(target=client) for _ in range(4)]
        for thread in clients:
            thread.start()
        # The shard dies once the clients are busy: after four answers.
        for _ in range(4):
            assert answered.acquire(timeout=60), stack.log()
        os.kill(shards[0], signal.SIGKILL)
        assert stack.process.wait(timeout=60) != 0, stack.log()
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
    finally:
        stop.set()
        stack.kill()

    refused = [(status, body) for status, body in statuses if status != 200]
    assert all(status == 503 for status, _ in refused), refused
    codes = set()
    for _, body in refused:
        error = json.loads(body)
        openai_schema.validate(error, "ErrorResponse")
        codes.add(error["error"]["code"])
    # Before the launcher stops the router, the dead shard is named; while the router drains,
    # new work is refused as the server shutting down.
    assert "shard_unavailable" in codes, (codes, stack.log())
    assert codes <= {"shard_unavailable", "service_unavailable"}, codes


def test_a_stream_outliving_the_grace_period_ends_with_an_error_event_and_done(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "grace-cut", graceful_shutdown_secs=1)
    long_request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**long_request, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        events = _sse_data(response)
        first = next(events)
        assert json.loads(first)["choices"], first

        plain: list[tuple[int, bytes]] = []
        collector = threading.Thread(target=lambda: plain.append(_post(stack, long_request)))
        collector.start()
        # SIGTERM once the server reports both requests running.
        deadline = time.monotonic() + 60
        while not _running(stack):
            assert collector.is_alive() and time.monotonic() < deadline, (plain, stack.log())
        stack.process.send_signal(signal.SIGTERM)

        rest = list(events)
        conn.close()
        collector.join(timeout=60)
        code = stack.process.wait(timeout=60)
    finally:
        stack.kill()

    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])
    openai_schema.validate(error, "ErrorResponse")
    assert error["error"]["code"] == "shutdown_grace_expired", error
    assert plain, "the non-streamed request got no answer"
    status, body = plain[0]
    assert status == 503, body
    assert json.loads(body)["error"]["code"] == "shutdown_grace_expired"
    assert code != 0, f"the launcher exited 0 although requests were cut\n{stack.log()}"


def _running(stack: Stack) -> bool:
    """Whether the server has two requests running (the stream and the non-streamed one)."""
    metrics = parse_prometheus(stack.get("/metrics")[1].decode())
    return any(name.startswith("quiver_requests_running") and value >= 2
               for name, value in metrics.items())
