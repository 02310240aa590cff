"""The launcher's lifecycle: SIGTERM drains in-flight streams and exits 0; a dead shard takes the
whole stack down with a non-zero exit and a log line naming it. Each test owns its stack."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai

from conftest import SHARD_ENV
from stack import Stack, StackConfig, wait_processes_gone

LONG = 1000  # a few seconds of decoding: the drain is observable


def _own_stack(pool, tmp_path, name: str, env: dict[str, str] | None = None, **config) -> Stack:
    model_dir = pool.model_dir("llama")
    cfg = StackConfig(model_id=str(model_dir), served_model_name="tiny", max_total_tokens=1024,
                      extra_env={**SHARD_ENV, **(env or {})}, **config)
    return Stack(cfg, tmp_path / f"{name}.log").start()


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _assert_all_gone(stack: Stack, spawned: list[int], timeout_s: float = 10) -> None:
    """Every process the launcher spawned has exited, and nothing is left in its group. The
    launcher gives each child a process group of its own, so its group alone would miss them:
    `spawned` is the process tree listed while the launcher was still their parent."""
    left = wait_processes_gone([*spawned, *stack.group_alive()], timeout_s)
    assert not left, f"children outlived the launcher: {left}\n{stack.log()}"


def _refused(client: openai.OpenAI) -> bool:
    """Whether a new request is turned away (503, or the listener already closed)."""
    try:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        return False
    except openai.APIConnectionError:
        return True
    except openai.InternalServerError as err:
        assert err.status_code == 503, err
        return True


def test_sigterm_drains_the_stream_in_flight_refuses_new_work_then_exits_0(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "sigterm", graceful_shutdown_secs=60)
    try:
        spawned = [pid for pid, _ in stack.descendants()]
        client = _client(stack)
        stream = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=LONG, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices, "the stream started"
        stack.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        rest: list = []
        drain = threading.Thread(target=lambda: rest.extend(chunks))
        drain.start()

        # The router stops taking work as soon as it has the signal; requests that slip in
        # before that are served normally, so ask until one is refused (each ask is a round
        # trip, which paces the loop).
        refused_during_drain = False
        while drain.is_alive() and not refused_during_drain:
            with _client(stack) as fresh:
                # Still streaming after the refusal came back: it was refused during the drain.
                refused_during_drain = _refused(fresh) and drain.is_alive()
        assert refused_during_drain, "no new request was refused while the stream drained"
        drain.join(timeout=60)
        assert not drain.is_alive(), "the stream did not finish within the grace period"

        reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices]
        assert reasons[-1] == "length", f"stream cut short: {reasons[-3:]}\n{stack.log()}"
        assert rest[-1].usage.completion_tokens == LONG

        code = stack.process.wait(timeout=60)
        assert code == 0, f"launcher exited {code} after a graceful drain\n{stack.log()}"
        # The promise under test is in seconds: --graceful-shutdown-secs (60) bounds the drain,
        # and the exit must come within it, so the bound is the flag's own value.
        assert time.monotonic() - signalled_at < 60
        _assert_all_gone(stack, spawned)
    finally:
        stack.kill()


def test_killed_shard_stops_everything_nonzero_and_is_named_in_the_log(pool, tmp_path):
    stack = _own_stack(pool, tmp_path, "shard-death")
    try:
        shards = [(pid, cmd) for pid, cmd in stack.descendants()
                  if "quiver-server" in cmd or "quiver_server" in cmd]
        assert shards, f"no shard process under the launcher: {stack.descendants()}"
        spawned = [pid for pid, _ in stack.descendants()]
        log_before = len(stack.log())
        os.kill(shards[0][0], signal.SIGKILL)

        code = stack.process.wait(timeout=30)
        assert code != 0, f"launcher exited 0 after its shard died\n{stack.log()}"
        after = stack.log()[log_before:].lower()
        assert "shard" in after, f"the log does not name the dead shard:\n{after}"
        _assert_all_gone(stack, spawned)
        try:
            _client(stack).models.list()
            raise AssertionError("the router still answers after its shard died")
        except openai.APIConnectionError:
            pass
    finally:
        stack.kill()


def test_a_killed_launchers_socket_folder_is_removed_by_the_next_launcher(pool, tmp_path):
    """SIGKILL runs no clean-up: the killed launcher's `quiver-<pid>` folder (and the shards'
    sockets in it) stays behind until the next launcher using the same TMPDIR removes it."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first = _own_stack(pool, tmp_path, "killed-launcher", env={"TMPDIR": str(tmpdir)})
    try:
        spawned = [pid for pid, _ in first.descendants()]
        left = tmpdir / f"quiver-{first.process.pid}"
        assert left.is_dir(), sorted(tmpdir.iterdir())
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=30)
        _assert_all_gone(first, spawned)
        assert left.is_dir(), "the test's premise: a SIGKILLed launcher leaves its folder"
    finally:
        first.kill()
    second = _own_stack(pool, tmp_path, "next-launcher", env={"TMPDIR": str(tmpdir)})
    try:
        assert not left.exists(), sorted(tmpdir.iterdir())
        assert (tmpdir / f"quiver-{second.process.pid}").is_dir()
    finally:
        second.stop()
