"""Starts the real quiver stack (`quiver-launcher` → shard + router) on a free loopback port.

Shared by the integration tests and the benchmarks (which import it through
bench/fixtures/stack.py). Nothing here is mocked: the launcher spawns `quiver-server` and `quiver-router` from
`.venv/bin`, exactly as `make serve` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = REPO_ROOT / ".venv" / "bin"
# QUIVER_BIN_DIR tests another build of the Rust binaries (e.g. target/release of a work tree)
# against this checkout's shard; by default the ones `make install` put in the venv.
BIN_DIR = Path(os.environ.get("QUIVER_BIN_DIR") or VENV_BIN)
LAUNCHER = BIN_DIR / "quiver-launcher"
STARTUP_TIMEOUT_S = 60.0
# How often /health is asked while the stack starts (shards take seconds to load).
HEALTH_PROBE_INTERVAL_S = 0.2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StackConfig:
    """What to serve and how; `model_id=None` serves the built-in demo model."""

    model_id: str | None
    cache_dir: Path | None = None
    served_model_name: str | None = None
    # None leaves a flag to the launcher's default.
    dtype: str | None = "float32"
    device: str | None = "cpu"
    cpu_kv_cache_gib: float | None = 0.05
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_size: int | None = None
    max_concurrent_requests: int | None = None
    graceful_shutdown_secs: int | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    def args(self, port: int) -> list[str]:
        args = ["--hostname", "127.0.0.1", "--port", str(port)]
        optional = {
            "--dtype": self.dtype,
            "--device": self.device,
            "--cpu-kv-cache-gib": self.cpu_kv_cache_gib,
            "--model-id": self.model_id,
            "--cache-dir": self.cache_dir,
            "--served-model-name": self.served_model_name,
            "--max-input-tokens": self.max_input_tokens,
            "--max-total-tokens": self.max_total_tokens,
            "--max-batch-prefill-tokens": self.max_batch_prefill_tokens,
            "--max-batch-size": self.max_batch_size,
            "--max-concurrent-requests": self.max_concurrent_requests,
            "--graceful-shutdown-secs": self.graceful_shutdown_secs,
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        return args + self.extra_args


class StackError(RuntimeError):
    pass


# Every stack started in this process, so the test session can prove none outlived it.
STARTED: list[Stack] = []


class Stack:
    """One running launcher. Use as a context manager, or call `start()`/`stop()`."""

    def __init__(self, config: StackConfig, log_path: Path):
        self.config = config
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def process(self) -> subprocess.Popen:
        """The launcher's process, once `start()` has spawned it."""
        if self.proc is None:
            raise StackError("the stack has not been started")
        return self.proc

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> Stack:
        if not LAUNCHER.exists():
            raise StackError(f"{LAUNCHER} is missing: run `make install` (or `make rust`) first")
        if self.proc is not None and self.proc.poll() is None:
            # A second launcher would lose the first one's process (left running) while its
            # /health probe got the first one's answer.
            raise StackError("this stack is running already: `with Stack(...)` starts it")
        env = dict(os.environ)
        # The launcher finds quiver-server / quiver-router on PATH (or next to itself).
        env["PATH"] = os.pathsep.join([str(BIN_DIR), str(VENV_BIN), env.get("PATH", "")])
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.config.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        # Own process group, so teardown can reach every descendant even if the launcher
        # misbehaves; the launcher itself only ever gets the signals a user would send.
        self.proc = subprocess.Popen(
            [str(LAUNCHER), *self.config.args(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        STARTED.append(self)
        log.close()
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Asks /health until it answers 200. Nothing announces readiness, so it is probed (as
        Kubernetes would); between probes the wait is on the launcher's exit, so a launcher
        that dies is reported at once, not at the deadline."""
        proc = self.process
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            try:
                code = proc.wait(timeout=HEALTH_PROBE_INTERVAL_S)
            except subprocess.TimeoutExpired:
                continue
            raise StackError(
                f"launcher exited with {code} before /health answered\n--- launcher log ---\n{self.log()}"
            )
        raise StackError(f"/health not 200 after {timeout_s:.0f}s\n--- launcher log ---\n{self.log()}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the launcher (a graceful drain, as Kubernetes would ask); its exit code."""
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort: SIGKILL the whole process group, and every process below the launcher.

        The launcher gives each child a process group of its own, so the group alone would miss
        a shard (and what it runs, e.g. a kernel build) when the launcher cannot clean up."""
        if self.proc is None:
            return
        below = [pid for pid, _ in self.descendants()] if self.proc.poll() is None else []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate(timeout_s=30)
        else:
            self.kill()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- inspection ------------------------------------------------------------------------

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"

    def get(self, path: str, timeout: float = 10) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post_raw(self, path: str, body: bytes, content_type: str = "application/json",
                 timeout: float = 30) -> tuple[int, bytes]:
        """POSTs bytes as they are (for malformed JSON the SDK could never send)."""
        req = urllib.request.Request(
            self.base_url + path, data=body, method="POST", headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post_json(self, path: str, payload: dict, timeout: float = 30) -> tuple[int, dict]:
        status, body = self.post_raw(path, json.dumps(payload).encode(), timeout=timeout)
        return status, json.loads(body)

    def metrics(self) -> dict[str, float]:
        """`GET /metrics` as {series (with labels, as printed): value}."""
        status, body = self.get("/metrics")
        if status != 200:
            raise StackError(f"GET /metrics answered {status}: {body[:200]!r}")
        return parse_prometheus(body.decode())

    def descendants(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process below the launcher."""
        return descendants_of(self.process.pid)

    def group_alive(self) -> list[int]:
        """Live processes of the launcher's process group (children outlive a dead parent)."""
        return group_members(self.process.pid)


def parse_prometheus(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    return values


def _stat_fields(pid_dir: Path) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, pgrp, ..."""
    try:
        return (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry)
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def descendants_of(root_pid: int) -> list[tuple[int, str]]:
    """Walks /proc (Linux) for the process tree under `root_pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[tuple[int, str]] = []
    todo = list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        found.append((pid, cmdline.decode(errors="replace").strip()))
        todo.extend(children.get(pid, []))
    return found


def wait_processes_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Waits until every process of `pids` has exited; those still alive at the deadline. Waits
    on each one's pidfd, which turns readable when the process exits (they need not be our
    children, so no waitpid)."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(pidfd)
    return [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    fields = _stat_fields(Path("/proc") / str(pid))
    return fields is not None and fields[0] != "Z"
