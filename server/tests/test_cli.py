"""`quiver-server` as the launcher and users run it: a subprocess, its exit code and its stderr."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from tiny_models import build_tiny_model
from transformers import GPT2Config, GPT2LMHeadModel

from quiver_server.pb import shard_pb2, shard_pb2_grpc

QUIVER_SERVER = str(Path(sys.executable).with_name("quiver-server"))
START_TIMEOUT_S = 120


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S):
    return subprocess.run(
        [QUIVER_SERVER, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


class StderrLines:
    """Collects a child's stderr lines on a thread so the test can wait for one without blocking."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(process,), daemon=True).start()

    def _pump(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"exited before {needle!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} within {timeout}s:\n" + "\n".join(self.lines))

    def drain(self) -> list[str]:
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return self.lines


@contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen[str], StderrLines]]:
    process = subprocess.Popen([QUIVER_SERVER, "serve", *args], stderr=subprocess.PIPE, text=True)
    try:
        yield process, StderrLines(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(directory, "llama")
    return directory


def test_serve_json_logs_ready_health_and_sigterm(tiny_llama: Path, tmp_path: Path) -> None:
    socket_path = tmp_path / "run" / "shard.sock"
    socket_path.parent.mkdir()
    # A socket file left behind by a crashed shard: nobody listens on it, so it must be replaced.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(socket_path))
    stale.close()

    with serving(str(tiny_llama), "--uds-path", str(socket_path), "--device", "cpu", "--json-logs") as (
        process,
        stderr,
    ):
        ready = json.loads(stderr.wait_for("shard ready"))
        assert ready["level"] == "INFO" and ready["target"].startswith("quiver_server")
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            stub.Health(shard_pb2.HealthRequest(), timeout=10)
            info = stub.Info(shard_pb2.InfoRequest(), timeout=10)
        assert info.model_type == "llama" and info.model_id == str(tiny_llama)

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        lines = stderr.drain()
    # Every line is one JSON object the launcher can forward.
    for line in lines:
        record = json.loads(line)
        assert set(record) == {"level", "message", "target"}, line
    assert not socket_path.exists()


def test_serve_unsupported_architecture_fails_naming_it(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    socket_path = tmp_path / "s.sock"
    result = run_cli("serve", str(tmp_path / "gpt2"), "--uds-path", str(socket_path), "--device", "cpu")
    assert result.returncode != 0
    assert "gpt2" in result.stderr
    assert not socket_path.exists()


def test_serve_missing_model_directory_fails(tmp_path: Path) -> None:
    result = run_cli("serve", str(tmp_path / "absent"), "--uds-path", str(tmp_path / "s.sock"))
    assert result.returncode == 1
    assert "does not exist" in result.stderr


def hub_cache_with(tmp_path: Path, repo: str, commit: str = "0123abcd") -> tuple[dict[str, str], Path]:
    """An offline HF cache holding one snapshot, laid out as huggingface_hub documents it."""
    cache = tmp_path / "hub"
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return env, snapshot


def test_download_prints_cached_snapshot_path_offline(tmp_path: Path) -> None:
    env, snapshot = hub_cache_with(tmp_path, "acme/tiny-model")
    result = run_cli("download", "acme/tiny-model", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(snapshot)


def test_download_of_uncached_repo_offline_fails_with_message(tmp_path: Path) -> None:
    env, _ = hub_cache_with(tmp_path, "acme/tiny-model")
    result = run_cli("download", "acme/other-model", env=env)
    assert result.returncode == 1
    assert "acme/other-model" in result.stderr and "HF_HUB_OFFLINE" in result.stderr
    assert result.stdout == ""


def test_download_progress_goes_to_the_log(caplog: pytest.LogCaptureFixture, capsys) -> None:
    """huggingface_hub drives our progress class as it does during a snapshot download: the
    progress arrives as log records, and nothing is drawn on the terminal."""
    from huggingface_hub.utils.tqdm import hf_thread_map

    from quiver_server.hub import LoggingProgress

    with caplog.at_level("INFO", logger="quiver_server.hub"):
        results = hf_thread_map(lambda x: x * 2, range(3), tqdm_class=LoggingProgress, desc="Fetching 3 files")
    assert results == [0, 2, 4]
    progress = [r.getMessage() for r in caplog.records if r.name == "quiver_server.hub"]
    assert any("Fetching 3 files" in m and "100%" in m and "3/3" in m for m in progress), progress
    assert capsys.readouterr().err == ""
