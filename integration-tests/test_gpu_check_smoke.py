"""`make gpu-check` on the CPU, so that the prepared GPU check cannot rot between GPU runs
(docs/gpu-check.md): the whole check at the tiny shape through a bundle of this checkout's
binaries (built with --no-wheels: the wheels are this venv's packages, so nothing is downloaded),
every phase's file with its fields, greedy agreement with transformers/peft; a run cut short
still reports; the bundle's wheel list covers what its wheels require."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from stack import REPO_ROOT

from bench.gpu_check import bundle as gpu_check_bundle
from bench.gpu_check.common import PROFILES, REPORT_FILES

TINY = PROFILES["tiny"]
# On the GPU machine's Python (3.12, Linux), where the wheels are installed.
GPU_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}


def _check(report_dir: Path, *args: str, bundle: Path | None = None, timeout: float = 240):
    command = [sys.executable, "-m", "bench.gpu_check.run", "--device", "cpu", "--shape", "tiny",
               "--report-dir", str(report_dir), *args]
    if bundle is not None:
        command += ["--bundle", str(bundle)]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _report(report_dir: Path, name: str) -> dict:
    return json.loads((report_dir / name).read_text())


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("gpu-check")
    bundle = tmp / "bundle"
    subprocess.run([sys.executable, "-m", "bench.gpu_check.bundle", "--no-wheels", "--out", str(bundle)],
                   cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    report_dir = tmp / "report"
    done = _check(report_dir, bundle=bundle)
    assert done.returncode == 0, done.stderr[-4000:]
    return report_dir


def test_every_phase_reports(full_run: Path) -> None:
    assert sorted(p.name for p in full_run.iterdir()) == sorted(REPORT_FILES)
    summary = _report(full_run, "summary.json")
    assert summary["status"] == "ok"
    assert {name: phase["status"] for name, phase in summary["phases"].items()} == {
        "env": "ok", "kernels": "ok", "quant": "ok", "model": "ok", "stack": "ok", "shard-tests": "ok"}


def test_env_names_device_versions_and_bundle(full_run: Path) -> None:
    env = _report(full_run, "env.json")
    assert env["device"]["type"] == "cpu"
    assert env["versions"]["torch"] and env["versions"]["transformers"] and env["versions"]["peft"]
    # The stack ran the bundle's launcher (and through it the bundle's quiver-server shim).
    assert env["launcher_version"].startswith("quiver-launcher ")
    assert env["prepared"]["bundle_manifest"]["binaries"]["quiver-router"]["stripped"] in (True, False)


def test_kernels_measure_against_copy_bandwidth_and_are_right(full_run: Path) -> None:
    kernels = _report(full_run, "kernels.json")
    assert kernels["status"] == "ok" and kernels["copy_bandwidth_gbs"] > 0
    assert len(kernels["paged_decode_attention"]) == len(TINY.attention_cases)
    for row in kernels["paged_decode_attention"]:
        assert "torch_gather" in row["results"] and any(n.startswith("ops.") for n in row["results"])
        for name, result in row["results"].items():
            assert "error" not in result, (name, result)
            assert result["rel_error_vs_torch"] < 1e-5, (name, result)
            assert result["us"] > 0 and result["share_of_copy_bandwidth"] >= 0
    assert kernels["lora"]
    for row in kernels["lora"]:
        for name in ("triton", "torch"):
            assert row["results"][name]["rel_error"] < 1e-5, (row["case"], name, row["results"][name])
        assert row["floor_bytes"] > 0


def test_quant_times_every_projection_and_format_against_the_dense_product(full_run: Path) -> None:
    quant = _report(full_run, "quant.json")
    assert quant["status"] == "ok" and quant["copy_bandwidth_gbs"] > 0
    assert [row["projection"] for row in quant["projections"]] == ["qkv", "o", "gate_up", "down"]
    for row in quant["projections"]:
        assert set(row["dense"]) == {"1", "4", "8"}
        assert set(row["formats"]) == {"int8", "int4-g128", "int4-g32"}
        for fmt, result in row["formats"].items():
            # float64 of the dequantized weight: float32 sums of K terms, nothing near a format's error
            assert all(error < 1e-5 for error in result["rel_error_vs_float64"].values()), (fmt, result)
            assert result["bytes"] < row["dense_bytes"]
            for rows, timed in result["rows"].items():
                assert timed["default"]["us"] > 0 and timed["speedup_vs_dense"] > 0
                assert ("dot_kernel" in timed) == (int(rows) <= 4)
    assert len(quant["gemv_sweep"]) == 4
    for case in quant["gemv_sweep"]:
        assert [set(r["config"]) for r in case["results"]] == [set(), {"magic"}]
        assert all("us" in r for r in case["results"]) and case["best"] in case["results"]
    summary = _report(full_run, "summary.json")
    assert set(summary["headline"]["quant_speedup_vs_dense"]) == {"int8", "int4-g128", "int4-g32"}


def test_served_greedy_equals_transformers_and_peft(full_run: Path) -> None:
    parity = _report(full_run, "parity.json")
    assert parity["status"] == "ok" and parity["dtype"] == "float32"
    assert parity["diverged"] == 0
    models = {row["model"] for row in parity["rows"]}
    assert len(models) == 1 + TINY.parity_adapters and "base" in models
    assert len(parity["rows"]) == len(models) * len(TINY.parity_prompt_tokens)
    for row in parity["rows"]:
        assert len(row["served"]) == TINY.parity_new_tokens
        assert row["verdict"] in ("exact", "near-tie"), row


def test_serve_measures_every_scenario(full_run: Path) -> None:
    serve = _report(full_run, "serve.json")
    assert serve["status"] == "ok"
    scenarios = {(row["scenario"], row["streams"]) for row in serve["scenarios"]}
    assert scenarios == {(label, streams) for streams in TINY.streams
                         for label in ("base", f"{TINY.adapters} adapters")}
    for row in serve["scenarios"]:
        assert row["generated_tokens"] == row["streams"] * TINY.requests_per_client * TINY.max_tokens
        assert row["throughput_tok_s"] > 0 and row["ttft_s"]["p50"] > 0 and row["inter_token_s"]["p50"] > 0
    assert set(serve["adapters_over_base"]) == {str(s) for s in TINY.streams}


def test_shard_tests_ran_on_the_device(full_run: Path) -> None:
    tests = _report(full_run, "shard-tests.json")
    assert tests["status"] == "ok" and tests["device"] == "cpu"
    assert tests["passed"] > 0 and tests["failed"] == 0 and tests["errors"] == 0
    assert any("passed" in line for line in tests["log"])


# Shard tests that cannot finish: one passes, the next waits until the phase's limit interrupts it.
UNFINISHED_TESTS = """
import time


def test_passes() -> None:
    assert True


def test_waits_for_the_interrupt() -> None:
    time.sleep(3600)
"""


def test_a_run_cut_short_still_reports(tmp_path: Path) -> None:
    """A phase past its limit is stopped and its file says so; pytest interrupted at the shard
    tests' own limit still reports the tests that ran."""
    tests_file = tmp_path / "unfinished" / "test_unfinished.py"
    tests_file.parent.mkdir()
    tests_file.write_text(UNFINISHED_TESTS)
    report_dir = tmp_path / "report"
    done = _check(report_dir, "--phases", "kernels,shard-tests", "--timeout", "kernels=2", "--timeout",
                  "shard-tests=45", "--shard-tests", str(tests_file))
    assert done.returncode == 1, done.stderr[-2000:]
    summary = _report(report_dir, "summary.json")
    assert summary["status"] == "failed"
    assert summary["phases"]["kernels"]["status"] == "timeout"
    assert _report(report_dir, "kernels.json")["status"] == "timeout"
    tests = _report(report_dir, "shard-tests.json")
    assert tests["interrupted"] and tests["status"] == "failed"
    assert tests["passed"] == 1  # from the JUnit XML pytest wrote on SIGINT


def test_bundle_wheels_cover_their_requirements() -> None:
    """Every requirement of a bundled wheel (as this venv's copy of it states, on the GPU
    machine's Python) is bundled too or on that machine; each pin is the venv's version."""
    bundled = {name.lower() for name in gpu_check_bundle.WHEELS}
    assert {"llguidance", "protobuf", "grpcio", "pytest"} <= bundled
    from importlib.metadata import requires, version

    for pin in gpu_check_bundle.wheel_pins():
        name, _, pinned = pin.partition("==")
        assert pinned == version(name)
        for line in requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(GPU_MARKERS):
                dependency = requirement.name.lower().replace("_", "-")
                assert dependency in bundled | set(gpu_check_bundle.ON_GPU_MACHINE), (name, line)
