"""The launcher's lifecycle: SIGTERM drains in-flight streams and exits 0; a dead shard takes the
whole stack down with a non-zero exit and a log line naming it. Each test owns its stack."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai

from conftest import SHARD_ENV
from stack import Stack, StackConfig

LONG = 600


def _own_stack(pool, tmp_path, name: str, **config) -> Stack:
    model_dir = pool.model_dir("llama")
    cfg = StackConfig(model_id=str(model_dir), served_model_name="tiny", max_total_tokens=1024,
                      extra_env=SHARD_ENV, **config)
    return Stack(cfg, tmp_path / f"{name}.log").start()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _assert_group_gone(stack: Stack, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.group_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stack.group_alive() == [], f"children outlived the launcher\n{stack.log()}"


def test_sigterm_drains_the_stream_in_flight_then_exits_0(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "sigterm", graceful_shutdown_secs=60)
    try:
        client = _client(stack)
        stream = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=LONG, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices, "the stream started"
        stack.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()

        rest = list(chunks)  # the drain must let the stream finish
        reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        assert reasons[-1] == "length", f"stream cut short: {reasons[-3:]}\n{stack.log()}"
        assert rest[-1].usage.completion_tokens == LONG

        code = stack.proc.wait(timeout=60)
        assert code == 0, f"launcher exited {code} after a graceful drain\n{stack.log()}"
        assert time.monotonic() - signalled_at < 60
        _assert_group_gone(stack)
    finally:
        stack.kill()


def test_new_requests_are_refused_while_draining(pool, tmp_path):
    """After SIGTERM the router takes no new work: a new request fails fast (503 or a refused
    connection), it is not queued behind the drain."""
    stack = _own_stack(pool, tmp_path, "refuse", graceful_shutdown_secs=60)
    try:
        client = _client(stack)
        stream = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=LONG, stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        stack.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        drained = threading.Thread(target=lambda: list(chunks))
        drained.start()
        try:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
            raise AssertionError("a request sent during the drain was accepted")
        except (openai.APIConnectionError, openai.InternalServerError) as err:
            if isinstance(err, openai.InternalServerError):
                assert err.status_code == 503, err
        drained.join(timeout=60)
        assert stack.proc.wait(timeout=60) == 0, stack.log()
    finally:
        stack.kill()


def test_killed_shard_stops_everything_nonzero_and_is_named_in_the_log(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "shard-death")
    try:
        shards = [(pid, cmd) for pid, cmd in stack.descendants()
                  if "quiver-server" in cmd or "quiver_server" in cmd]
        assert shards, f"no shard process under the launcher: {stack.descendants()}"
        log_before = len(stack.log())
        os.kill(shards[0][0], signal.SIGKILL)

        code = stack.proc.wait(timeout=30)
        assert code != 0, f"launcher exited 0 after its shard died\n{stack.log()}"
        after = stack.log()[log_before:].lower()
        assert "shard" in after, f"the log does not name the dead shard:\n{after}"
        _assert_group_gone(stack)
        try:
            _client(stack).models.list()
            raise AssertionError("the router still answers after its shard died")
        except openai.APIConnectionError:
            pass
    finally:
        stack.kill()
