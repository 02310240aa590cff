"""The peers of `make bench-peers` as processes: vLLM's CPU build and llama.cpp's llama-server,
each started on a free loopback port with the flags documented in docs/benchmarks-peers.md,
waited for on /health, stopped with its process group. quiver itself runs through
integration-tests/stack.py (the real launcher).

Every server is described by a `PeerServer`: a label for the report, the command, the
environment, and how a request names the model or one of its adapters (`selection`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.fixtures.stack import free_port

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
HEALTH_PROBE_INTERVAL_S = 0.5


class PeerUnavailable(RuntimeError):
    """A peer that could not be installed or started; the report says why."""


@dataclass
class PeerServer:
    label: str
    command: list[str]
    log_path: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    # request fields per served name: how a request picks the base model or an adapter
    model_bodies: dict[str, dict] = field(default_factory=dict)
    # fields every request carries (llama-server's per-request cache switch)
    extra_body: dict = field(default_factory=dict)
    flags_note: str = ""
    # An environment variable that gets a private scratch folder, removed at stop: vLLM puts
    # its ZeroMQ sockets in the temp folder and leaves them there when it is killed.
    scratch_env: str = ""
    proc: subprocess.Popen | None = None
    scratch: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.env}
        if self.scratch_env:
            self.scratch = Path(tempfile.mkdtemp(prefix=f"quiver-bench-{self.label}-"))
            env[self.scratch_env] = str(self.scratch)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            try:
                code = self.proc.wait(timeout=HEALTH_PROBE_INTERVAL_S)
            except subprocess.TimeoutExpired:
                continue
            raise PeerUnavailable(f"{self.label} exited with {code} before /health answered: {self.log_tail()}")
        self.stop()
        raise PeerUnavailable(f"{self.label}: /health not 200 after {timeout_s:.0f}s: {self.log_tail()}")

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)
                self.scratch = None

    def _stop_process(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, chars: int = 1200) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"


@dataclass(frozen=True)
class Limits:
    max_model_len: int  # prompt + output of the longest request
    max_seqs: int  # streams at once
    kv_tokens: int  # tokens of KV the workload holds at once


def vllm_env(venv: Path, kv_gib: int) -> dict[str, str]:
    """The environment vLLM's CPU documentation asks for (docs/benchmarks-peers.md says why each):
    tcmalloc and Intel OpenMP preloaded, OpenMP threads bound one per core over every core of the
    host with none reserved (on 2 cores, reserving one for the front end halves the compute), and
    the KV cache size."""
    iomp = next(iter(sorted(venv.glob("lib/libiomp5.so"))), None) or next(
        iter(sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))), None)
    preload = [str(p) for p in (TCMALLOC if TCMALLOC.exists() else None, iomp) if p is not None]
    cores = os.cpu_count() or 1
    return {
        "LD_PRELOAD": ":".join(preload + [p for p in [os.environ.get("LD_PRELOAD", "")] if p]),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # KV cache space in GiB (vLLM's CPU backend sizes its cache from this, not from a fraction).
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
    }


def vllm(venv: Path, model_dir: Path, served: str, logs: Path, limits: Limits, *, prefix_caching: bool,
         lora_paths: dict[str, Path] | None, eager: bool, kv_gib: int, label: str, dtype: str = "float32",
         max_num_batched_tokens: int | None = None, max_lora_rank: int = 16,
         kv_cache_dtype: str | None = None) -> PeerServer:
    """vLLM's OpenAI server. Run as the module behind `vllm serve` (the `vllm` CLI reads its own
    version from the `vllm` distribution, and the package is installed as `vllm-cpu`)."""
    port = free_port()
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.launchers.api_server.entry",
               "--model", str(model_dir), "--served-model-name", served, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(limits.max_model_len),
               "--max-num-seqs", str(limits.max_seqs),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_cache_dtype is not None:
        command += ["--kv-cache-dtype", kv_cache_dtype]
    if eager:
        command.append("--enforce-eager")
    if lora_paths:
        command += ["--enable-lora", "--max-loras", str(len(lora_paths)), "--max-lora-rank", str(max_lora_rank),
                    "--lora-modules", *[f"{name}={path}" for name, path in lora_paths.items()]]
    env = vllm_env(venv, kv_gib)
    return PeerServer(label, command, logs / f"{label}.log", port, env=env,
                      flags_note=" ".join(command[3:]) + " | " + " ".join(f"{k}={v}" for k, v in env.items()),
                      scratch_env="VLLM_RPC_BASE_PATH")


def llama_server(binary: Path, gguf: Path, served: str, loras: dict[str, Path], logs: Path, limits: Limits,
                 threads: int, *, prefix_caching: bool, label: str) -> PeerServer:
    """llama.cpp's llama-server: `limits.max_seqs` slots over one unified KV cache, every adapter
    loaded and picked per request (`lora: [{id, scale}]`)."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(limits.max_seqs), "--ctx-size", str(limits.kv_tokens), "--kv-unified",
               "--threads", str(threads), "--threads-batch", str(threads), "--batch-size", "2048",
               "--ubatch-size", "512", "--no-warmup", "--metrics"]
    if not prefix_caching:
        command += ["--cache-ram", "0"]
    for path in loras.values():
        command += ["--lora", str(path)]
    # Every request names every adapter's scale: one left out of a request's list keeps its global
    # scale (1.0 as loaded; --lora-init-without-apply did not change that here), so a base request
    # lists them all at 0 and an adapter's request its own at 1.
    names = list(loras)
    model_bodies = {name: {"model": name, "lora": [{"id": i, "scale": 1.0 if other == name else 0.0}
                                                   for i, other in enumerate(names)]}
                    for name in [served, *names]} if names else {}
    return PeerServer(label, command, logs / f"{label}.log", port, model_bodies=model_bodies,
                      extra_body={"cache_prompt": prefix_caching}, flags_note=" ".join(command[1:]))
