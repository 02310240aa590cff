"""`make gpu-check` phase `shard-tests` -> shard-tests.json: the shard tests on the
check's device (`QUIVER_TEST_DEVICE`, server/tests/device.py), the C++ CPU-kernel tests deselected
(nothing builds them on a GPU machine). On CUDA the default files are the ones that honour the
switch plus the Triton kernels' tests, and any test file of a newer kernel (the globs of
`SHARD_TEST_GLOBS`). When the phase's time runs out pytest gets SIGINT, so it still writes its
JUnit XML of the tests that ran, which the counts come from. The end of pytest's output goes into
the same file (`log`): the device tool returns at most 8 report files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.fixtures.paths import REPO_ROOT
from bench.gpu_check.common import SHARD_TEST_GLOBS, log, phase_options, write_report

# Of the phase's time, kept for pytest's exit after SIGINT and for writing the report.
MARGIN_S = 20.0
LOG_LINES = 150


def test_args(listed: tuple[str, ...], device: str) -> list[str]:
    args = list(listed)
    if device == "cuda":
        tests = REPO_ROOT / "server" / "tests"
        for pattern in SHARD_TEST_GLOBS:
            for path in sorted(tests.glob(pattern)):
                name = str(path.relative_to(REPO_ROOT))
                if name not in args:
                    args.append(name)
    return args


def junit_counts(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            element = case.find(outcome)
            if element is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                               "message": (element.get("message") or "")[:600]})
    return {"passed": totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"],
            "failed": totals["failures"], "errors": totals["errors"], "skipped": totals["skipped"],
            "seconds": round(sum(float(s.get("time", 0)) for s in suites), 1), "failures": failed[:50]}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main() -> None:
    options = phase_options()
    work = options.work
    junit = work / "shard-tests.xml"
    output = work / "shard-tests.out"
    args = test_args(options.profile.shard_tests, options.device)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
               "-m", "not cpu_kernels", f"--junitxml={junit}", *args]
    # The GPU machine's own pytest plugins are built for its pytest, not the bundle's.
    env = {**os.environ, "QUIVER_TEST_DEVICE": options.device, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    margin = min(MARGIN_S, options.phase_timeout_s / 4)
    limit = options.phase_timeout_s - margin
    started = time.perf_counter()
    interrupted = False
    with output.open("wb") as out:
        # SIGINT back to its default in pytest: a shell that runs the check in the background
        # (CI, nohup) starts it with SIGINT ignored, and pytest would then never stop to report.
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_default_sigint)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            interrupted = True
            log(f"shard tests still running after {limit:.0f} s: interrupted")
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=margin / 2)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    lines = output.read_text(errors="replace").splitlines()
    report: dict[str, Any] = {"device": options.device, "args": args, "exit_code": code, "interrupted": interrupted,
                              "wall_s": round(time.perf_counter() - started, 1),
                              "log": [" ".join(command), *lines[-LOG_LINES:]]}
    if junit.exists():
        report |= junit_counts(junit)
    else:  # interrupted before pytest wrote anything (still collecting): no test ran
        report |= {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "junit": "missing"}
    report["status"] = "ok" if code == 0 and not interrupted else "failed"
    write_report(options, "shard-tests.json", report)
    log(f"shard tests: {report.get('passed')} passed, {report.get('failed')} failed, "
        f"{report.get('errors')} errors (exit {code})")


if __name__ == "__main__":
    main()
