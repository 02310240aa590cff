"""`make soak`: the reliability suite (test_reliability_*.py) at QUIVER_SOAK's scale, ten times
the examples and rounds of `make test` unless --factor says otherwise. Not part of `make test`.

Prints one JSON summary (and writes it to bench/results/soak-<time>.json): requests sent and
their outcomes, the most memory any router held, the duration, and the tests that failed.
Exits with pytest's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = ["test_reliability_hostile.py", "test_reliability_churn.py", "test_reliability_faults.py"]
# How often router memory is sampled; its peak (VmHWM) is kept by the kernel, so a sample
# missed between two polls loses nothing but a router that lived less than this long.
RSS_POLL_S = 0.5


class RouterPeakMemory:
    """The highest resident memory (VmHWM) of any quiver-router started below this process."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        from stack import descendants_of

        while not self._stop.wait(RSS_POLL_S):
            for pid, cmd in descendants_of(os.getpid()):
                if "quiver-router" in cmd.split(" ", 1)[0]:
                    self.peak_kib = max(self.peak_kib, _vm_hwm_kib(pid))

    def __enter__(self) -> RouterPeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Outcomes:
    """A pytest plugin that counts passed tests and names the failed ones."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.failed:
            self.failed.append(f"{report.nodeid} ({report.when})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=int, default=None, help="scale over `make test` (default 10)")
    parser.add_argument("--results-dir", type=Path, default=HERE.parent / "bench" / "results")
    # Anything else goes to pytest (e.g. -k churn).
    args, pytest_args = parser.parse_known_args()
    # Read by reliability_soak when the tests import it, so set before pytest runs.
    os.environ["QUIVER_SOAK"] = "1"
    if args.factor is not None:
        os.environ["QUIVER_SOAK_FACTOR"] = str(args.factor)
    sys.path.insert(0, str(HERE))
    import pytest

    from reliability_soak import SOAK_FACTOR, TALLY

    outcomes = Outcomes()
    started = time.monotonic()
    with RouterPeakMemory() as memory:
        code = pytest.main([*(str(HERE / test) for test in TESTS), "-q", *pytest_args], plugins=[outcomes])
    summary = {
        "soak_factor": SOAK_FACTOR,
        "duration_s": round(time.monotonic() - started, 1),
        "requests_sent": TALLY.total(),
        "outcomes": dict(sorted(TALLY.outcomes.items())),
        "max_router_rss_mib": round(memory.peak_kib / 1024, 1),
        "tests_passed": outcomes.passed,
        "failures": outcomes.failed,
        "pytest_exit_code": int(code),
    }
    report = json.dumps(summary, indent=2)
    print(report)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(report + "\n")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
