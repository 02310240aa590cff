"""`make gpu-check REPORT_DIR=DIR`: one prepared, offline check of quiver on a machine with one
NVIDIA GPU, writing a JSON report per phase into DIR (docs/gpu-check.md).

    python3 -m bench.gpu_check.run --report-dir DIR --bundle .cache/gpu-bundle          # the GPU run
    python -m bench.gpu_check.run --report-dir DIR --device cpu --shape tiny            # CI's smoke run

The GPU machine has torch, triton, transformers, peft, safetensors and tokenizers and nothing of
ours: `make gpu-bundle` prepares the rest here (bundle.py), and this script installs its
wheels into the work directory, puts its gRPC modules in place and has the stack run its
binaries. Then each phase runs as its own process under a time limit, so one that hangs or dies
costs only itself, and each writes its report file as it ends:

    env          env.json                          device, versions, commit, what was prepared
    kernels      kernels.json                      LoRA SGMV/BGMV and paged decode attention vs copy bandwidth
    quant        quant.json                        quantized projections (int8, int4) vs the dense F.linear
    model        (work dir)                        random model + adapters, transformers/peft greedy reference
    stack        parity.json, serve.json, stack.log   served greedy vs the reference; load at each stream count
    shard-tests  shard-tests.json                  the shard tests on the device (counts, failures, log tail)

summary.json is rewritten after every phase. The run stays inside `--budget-s` (each phase gets
the smaller of its own limit and what is left); a phase that times out is stopped (SIGTERM, so the
stack is torn down, then SIGKILL) and its files say so. Only the standard library here: the
wheels are installed by this process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fixtures.paths import REPO_ROOT
from bench.gpu_check.common import Options, PHASES, PROFILES, log, write_report

# The report files each phase writes; the model phase writes none of its own (its result is
# parity's input), so its failure is reported in the stack phase's files.
PHASE_FILES = {"env": ("env.json",), "kernels": ("kernels.json",), "quant": ("quant.json",),
               "model": ("parity.json", "serve.json"),
               "stack": ("parity.json", "serve.json"), "shard-tests": ("shard-tests.json",)}
# Each phase's module, run as `python -m` from the repository root (so it imports bench.…).
PHASE_MODULES = {name: "bench.gpu_check.phase_" + name.replace("-", "_") for name in PHASE_FILES}
# Bytes the model phase writes into the work directory (model + adapters), with room to spare:
# tmpfs is used when it holds that much (no disk in the way of an 8B save and load).
WORK_BYTES = {"llama3-8b": 21 << 30, "tiny": 256 << 20}
TERM_GRACE_S = 30.0
MIN_PHASE_S = 10.0
LOG_TAIL_CHARS = 4000


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report-dir", type=Path, required=True)
    p.add_argument("--bundle", type=Path, help="make gpu-bundle's directory (default: none, this checkout's .venv)")
    p.add_argument("--shape", choices=sorted(PROFILES), default="llama3-8b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--budget-s", type=float, help="the whole run's seconds (default: 540 on cuda, 300 on cpu)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset, run in the fixed order")
    p.add_argument("--timeout", action="append", default=[], metavar="PHASE=SECONDS",
                   help="a phase's own limit (repeatable)")
    p.add_argument("--shard-tests", help="pytest arguments for the shard-tests phase (shell words)")
    p.add_argument("--work-dir", type=Path, help="default: a new directory in /dev/shm if it has room, else in TMPDIR")
    p.add_argument("--keep-work-dir", action="store_true")
    return p.parse_args()


def make_work_dir(shape: str) -> Path:
    needed = WORK_BYTES[shape]
    shm = Path("/dev/shm")
    base = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize > needed:
            base = shm
    return Path(tempfile.mkdtemp(prefix="quiver-gpu-check-", dir=base))


def prepare_bundle(bundle: Path, work: Path) -> tuple[dict[str, Any], Path | None, Path]:
    """Installs the bundle's wheels into `work/site`, puts its gRPC modules into the package where
    they are missing, makes its binaries executable. Returns (what was done, site, bin dir)."""
    if not (bundle / "manifest.json").exists():
        raise SystemExit(f"{bundle} holds no bundle: run `make gpu-bundle` and carry .cache/gpu-bundle")
    manifest = json.loads((bundle / "manifest.json").read_text())
    prepared: dict[str, Any] = {"bundle": str(bundle), "bundle_manifest": manifest}
    site: Path | None = None
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if wheels:
        site = work / "site"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)],
                              capture_output=True, text=True)
        prepared["wheels_installed"] = done.returncode == 0
        prepared["wheels_install_s"] = round(time.perf_counter() - started, 1)
        if done.returncode != 0:
            prepared["wheels_error"] = (done.stdout + done.stderr)[-LOG_TAIL_CHARS:]
    pb_dir = REPO_ROOT / "server" / "quiver_server" / "pb"
    copied = []
    for module in sorted((bundle / "pb").glob("*.py")):
        if not (pb_dir / module.name).exists():
            shutil.copy(module, pb_dir / module.name)
            copied.append(module.name)
    prepared["pb_copied"] = copied
    bin_dir = bundle / "bin"
    for binary in bin_dir.iterdir():
        with contextlib.suppress(OSError):
            binary.chmod(binary.stat().st_mode | 0o111)
    return prepared, site, bin_dir


def phase_env(site: Path | None, bin_dir: Path | None, device: str) -> dict[str, str]:
    paths = [str(p) for p in (site, REPO_ROOT / "server") if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false",
           # The bundle's quiver-server shim runs the shard with this interpreter.
           "QUIVER_PYTHON": sys.executable}
    if bin_dir is not None:
        env["QUIVER_BIN_DIR"] = str(bin_dir)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # before any import of triton in the phases
    else:
        env["QUIVER_CPU_KERNELS"] = "0"  # nothing of the check needs the C++ CPU kernels built there
    return env


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stop_leftover_stack(work: Path) -> None:
    """The launcher runs in a session of its own: if its phase died without stopping it, its
    process group goes here."""
    pid_file = work / "stack.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        pid_file.unlink()


def mark_unfinished(options: Options, file: str, phase: str, result: dict[str, Any], tail: str) -> None:
    """A phase file its phase did not finish: written if missing, its status replaced if the
    phase wrote part of it (kept as it is where the phase finished it: status "ok")."""
    path = Path(options.report_dir) / file
    report = _read(path.parent, file) if path.exists() else {}
    if report.get("status") == "ok":
        return
    write_report(options, file, {**report, "phase": phase, **result, "log_tail": tail})


def run_phase(name: str, options: Options, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    options = dataclasses.replace(options, phase_timeout_s=timeout_s)
    options_path = options.work / f"options-{name}.json"
    options.save(options_path)
    log_path = options.work / f"phase-{name}.log"
    started = time.perf_counter()
    with log_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", PHASE_MODULES[name], str(options_path)],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop_group(proc, TERM_GRACE_S)
            code, status = None, "timeout"
    _stop_leftover_stack(options.work)
    tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    result = {"status": status, "exit_code": code, "seconds": round(time.perf_counter() - started, 1),
              "timeout_s": round(timeout_s, 1)}
    for file in PHASE_FILES[name]:
        if status != "ok":
            mark_unfinished(options, file, name, result, tail)
        elif name != "model" and not (Path(options.report_dir) / file).exists():
            write_report(options, file, {"phase": name, **result, "status": "missing", "log_tail": tail})
    if status != "ok":
        result["log_tail"] = tail[-1500:]
    log(f"phase {name}: {status} in {result['seconds']} s")
    return result


def _read(report_dir: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((report_dir / name).read_text())
    except (OSError, ValueError):
        return {}


def _quant_speedups(quant: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in quant.get("projections", []):
        for fmt, result in row.get("formats", {}).items():
            out.setdefault(fmt, {})[row["projection"]] = {
                rows: timed["speedup_vs_dense"] for rows, timed in result.get("rows", {}).items()}
    return out


def headline(report_dir: Path) -> dict[str, Any]:
    """The numbers a reader wants first, taken from the phase files."""
    env, kernels = _read(report_dir, "env.json"), _read(report_dir, "kernels.json")
    parity, serve, tests = (_read(report_dir, n) for n in ("parity.json", "serve.json", "shard-tests.json"))
    quant = _read(report_dir, "quant.json")
    device = env.get("device", {})
    attention = {
        f"b{row['sequences']} ctx{row['context']}": {name: r.get("share_of_copy_bandwidth", r.get("error"))
                                                    for name, r in row["results"].items()}
        for row in kernels.get("paged_decode_attention", [])}
    lora = {row["case"]: (row.get("results", {}).get("triton", {}).get("graph")
                          or row.get("results", {}).get("triton", {})).get("share_of_copy_bandwidth")
            for row in kernels.get("lora", []) if "results" in row}
    return {
        "device": device.get("name") or device.get("type"),
        "memory_gib": device.get("memory_gib"),
        "versions": {k: env.get("versions", {}).get(k) for k in ("torch", "triton", "transformers", "peft")},
        "copy_bandwidth_gbs": kernels.get("copy_bandwidth_gbs"),
        "paged_decode_attention_share": attention,
        "lora_triton_share": lora,
        # per format: projection -> {rows: the quantized product's speed-up over the dense one}
        "quant_speedup_vs_dense": _quant_speedups(quant),
        "parity": {k: parity.get(k) for k in ("status", "exact", "near_tie", "diverged")},
        "serve": [{k: row.get(k) for k in ("scenario", "streams", "throughput_tok_s")}
                  | {"ttft_p50_s": row.get("ttft_s", {}).get("p50"),
                     "itl_p50_s": row.get("inter_token_s", {}).get("p50")}
                  for row in serve.get("scenarios", [])],
        "adapters_over_base": serve.get("adapters_over_base"),
        "shard_tests": {k: tests.get(k) for k in ("passed", "failed", "errors", "skipped", "interrupted")},
    }


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    profile = PROFILES[args.shape]
    if args.shard_tests is not None:
        profile = dataclasses.replace(profile, shard_tests=tuple(shlex.split(args.shard_tests)))
    timeouts = dict(profile.timeouts)
    for item in args.timeout:
        phase, _, seconds = item.partition("=")
        if phase not in timeouts:
            raise SystemExit(f"--timeout {item}: unknown phase {phase!r}")
        timeouts[phase] = float(seconds)
    profile = dataclasses.replace(profile, timeouts=timeouts)
    budget = args.budget_s or (540.0 if args.device == "cuda" else 300.0)
    selected = [p for p in args.phases.split(",") if p]
    unknown = set(selected) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; phases are {','.join(PHASES)}")

    args.report_dir.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or make_work_dir(args.shape)
    work.mkdir(parents=True, exist_ok=True)
    log(f"work directory {work}")
    prepared: dict[str, Any] = {}
    site = bin_dir = None
    if args.bundle is not None:
        prepared, site, bin_dir = prepare_bundle(args.bundle.resolve(), work)
    options = Options(profile=profile, device=args.device, report_dir=str(args.report_dir.resolve()),
                      work_dir=str(work), bundle=str(args.bundle) if args.bundle else None,
                      bin_dir=str(bin_dir) if bin_dir else None, prepared=prepared)
    env = phase_env(site, bin_dir, args.device)
    summary: dict[str, Any] = {"status": "running", "shape": args.shape, "device": args.device, "budget_s": budget,
                               "wheels_installed": prepared.get("wheels_installed"), "phases": {}}
    try:
        for name in PHASES:
            if name not in selected:
                continue
            left = budget - (time.monotonic() - started)
            if name == "stack" and not options.reference_path.exists():
                summary["phases"][name] = {"status": "skipped", "reason": "the model phase left no reference"}
            elif left < MIN_PHASE_S:
                summary["phases"][name] = {"status": "not run", "reason": f"budget spent ({left:.0f} s left)"}
                for file in PHASE_FILES[name]:
                    if not (args.report_dir / file).exists():
                        write_report(options, file, {"status": "not run", "phase": name})
            else:
                summary["phases"][name] = run_phase(name, options, env, min(timeouts[name], left))
            summary |= {"elapsed_s": round(time.monotonic() - started, 1), "headline": headline(args.report_dir)}
            write_report(options, "summary.json", summary)
    finally:
        if not args.keep_work_dir and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    reports_ok = all(_read(args.report_dir, f).get("status") == "ok"
                     for name in selected if name in ("stack", "shard-tests") for f in PHASE_FILES[name])
    phases_ok = all(p.get("status") == "ok" for p in summary["phases"].values())
    prepared_ok = prepared.get("wheels_installed", True)
    summary["status"] = "ok" if phases_ok and reports_ok and prepared_ok else "failed"
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    write_report(options, "summary.json", summary)
    log(f"{summary['status']} in {summary['elapsed_s']} s; report in {args.report_dir}")
    print(json.dumps(summary["headline"], indent=1))
    return 0 if summary["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
