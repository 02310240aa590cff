"""`make gpu-bundle`: what `make gpu-check` needs on a GPU machine that has torch, triton,
transformers, peft, safetensors and tokenizers (Python 3.12, x86-64, no network) and nothing else,
gathered into one directory (default .cache/gpu-bundle, ignored by git) to carry there:

    bin/quiver-launcher, bin/quiver-router   the release binaries, stripped
    bin/quiver-server                        a shim: `$QUIVER_PYTHON -m quiver_server.cli` (the
                                             launcher runs the quiver-server beside it)
    pb/*.py                                  the generated gRPC modules (not tracked by git)
    wheels/*.whl                             CPython 3.12 manylinux x86-64 wheels, at the versions
                                             this venv has, of what the shard and its tests import
                                             and the machine lacks (WHEELS)
    manifest.json                            commit, versions, sizes, the glibc the binaries need

The bundle must stay small enough that the repository and it travel together (64 MiB):
`--max-mib` (48) fails the build past it. `--no-wheels` leaves the downloads out (the CI smoke
test builds such a bundle to run the check through the shim and the bundled binaries).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.fixtures.paths import REPO_ROOT

BINARIES = ("quiver-launcher", "quiver-router")
PB_DIR = REPO_ROOT / "server" / "quiver_server" / "pb"
# What the shard (llguidance, grpcio, protobuf) and its tests (pytest and its needs; jsonschema
# and its needs for the grammar tests) import beyond the GPU machine's packages. attrs, pygments
# and typing-extensions are there already.
WHEELS = ("llguidance", "protobuf", "grpcio", "pytest", "pluggy", "iniconfig", "packaging", "jsonschema",
          "referencing", "jsonschema-specifications", "rpds-py")
# Of what the bundled wheels require, what the GPU machine has (device README's package list).
ON_GPU_MACHINE = ("attrs", "pygments", "typing-extensions")
# pip matches a manylinux tag's glibc version exactly, so every one the machine's glibc runs is named.
PLATFORMS = ["manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
PYTHON_VERSION = "3.12"
SHIM = """#!/bin/sh
# quiver-server for the launcher beside it: the shard from this checkout (PYTHONPATH) run by
# QUIVER_PYTHON (make gpu-check sets both).
exec "${QUIVER_PYTHON:-python3}" -m quiver_server.cli "$@"
"""


def wheel_pins() -> list[str]:
    """`name==version` of every bundled wheel, at the version installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]


def download_wheels(dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp",
                    "--abi", "cp" + PYTHON_VERSION.replace(".", ""), "--abi", "abi3", "--abi", "none",
                    *platforms, "--platform", "any", "-d", str(dest), *wheel_pins()], check=True)
    names = sorted(p.name for p in dest.glob("*.whl"))
    if len(names) != len(WHEELS):
        raise SystemExit(f"expected one wheel per package of {WHEELS}, got {names}")
    return names


def find_binary(name: str) -> Path:
    """The release build (`make rust`), else the copy `make install` put into the venv."""
    for candidate in (REPO_ROOT / "target" / "release" / name, REPO_ROOT / ".venv" / "bin" / name):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"{name} is not built: run `make rust`")


def glibc_needed(path: Path) -> str | None:
    """The newest GLIBC_2.N symbol version the binary asks for (the machine's glibc must have it)."""
    versions = {int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", path.read_bytes())}
    return f"2.{max(versions)}" if versions else None


def copy_binaries(bin_dir: Path) -> dict[str, dict]:
    bin_dir.mkdir(parents=True)
    out = {}
    strip = shutil.which("strip")
    for name in BINARIES:
        source, target = find_binary(name), bin_dir / name
        if strip:
            subprocess.run([strip, "--strip-all", "-o", str(target), str(source)], check=True)
        else:
            shutil.copy2(source, target)
        target.chmod(0o755)
        out[name] = {"from": str(source.relative_to(REPO_ROOT)), "bytes": target.stat().st_size,
                     "stripped": bool(strip), "glibc": glibc_needed(target)}
    shim = bin_dir / "quiver-server"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    return out


def copy_pb(pb_out: Path) -> list[str]:
    """The generated modules, unless git tracks them (then they travel with the tree)."""
    pb_out.mkdir(parents=True)
    tracked = set(subprocess.run(["git", "ls-files", "server/quiver_server/pb"], cwd=REPO_ROOT, capture_output=True,
                                 text=True).stdout.split())
    copied = []
    for module in sorted(PB_DIR.glob("*_pb2*.py")):
        if str(module.relative_to(REPO_ROOT)) not in tracked:
            shutil.copy2(module, pb_out / module.name)
            copied.append(module.name)
    if not copied and not tracked & {"server/quiver_server/pb/shard_pb2.py"}:
        raise SystemExit("the gRPC modules are not generated: run `make proto-py`")
    return copied


def git(*args: str) -> str | None:
    done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def build(out: Path, wheels: bool) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": PYTHON_VERSION,
        "binaries": copy_binaries(out / "bin"),
        "pb": copy_pb(out / "pb"),
        "wheels": download_wheels(out / "wheels") if wheels else [],
        "wheel_pins": wheel_pins() if wheels else [],
    }
    manifest["bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "gpu-bundle")
    p.add_argument("--no-wheels", action="store_true", help="binaries, shim and gRPC modules only")
    p.add_argument("--max-mib", type=float, default=48.0)
    args = p.parse_args()
    manifest = build(args.out, wheels=not args.no_wheels)
    mib = manifest["bytes"] / 2**20
    for name, info in manifest["binaries"].items():
        print(f"  bin/{name}: {info['bytes'] / 2**20:.1f} MiB (glibc {info['glibc']})")
    print(f"  wheels: {len(manifest['wheels'])}, pb modules: {len(manifest['pb'])}")
    print(f"gpu bundle: {mib:.1f} MiB in {args.out}")
    if mib > args.max_mib:
        raise SystemExit(f"the bundle is {mib:.1f} MiB, over --max-mib {args.max_mib}")


if __name__ == "__main__":
    main()
