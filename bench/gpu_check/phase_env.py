"""`make gpu-check` phase `env` -> env.json: the device (name, memory, capability, driver), the
versions of everything the check runs on, the commit, and what the orchestrator prepared from the
bundle (wheels installed, gRPC modules copied, the bundle's own manifest)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

import torch

from bench.fixtures.paths import REPO_ROOT
from bench.gpu_check.common import phase_options, write_report

PACKAGES = ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "huggingface-hub", "numpy",
            "grpcio", "protobuf", "llguidance", "pytest", "jsonschema")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _run(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _device(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"type": device, "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        "type": "cuda",
        "name": props.name,
        "memory_gib": round(total / 2**30, 2),
        "free_gib": round(free / 2**30, 2),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "cuda_runtime": torch.version.cuda,
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "device_count": torch.cuda.device_count(),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                            "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    options = phase_options()
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    manifest = options.prepared.get("bundle_manifest") or {}
    report = {
        "device": _device(options.device),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "versions": _versions(),
        # The bundle's commit is the code's: a copied tree's .git can be older than its files (the
        # first H100 run's said 1f6efc1 for a tree at cc500f6). Git's own HEAD is kept beside it.
        "commit": manifest.get("commit") or _run(["git", "rev-parse", "HEAD"]),
        "git_head": _run(["git", "rev-parse", "HEAD"]),
        "bundle_commit": manifest.get("commit"),
        "bundle_dirty": manifest.get("dirty"),
        "shape": options.profile.shape,
        "prepared": options.prepared,
        "launcher_version": _run([os.path.join(options.bin_dir, "quiver-launcher"), "--version"])
        if options.bin_dir else None,
    }
    write_report(options, "env.json", report)


if __name__ == "__main__":
    main()
