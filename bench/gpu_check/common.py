"""What every phase of `make gpu-check` shares: the run's options (one JSON file the orchestrator
writes and each phase reads), the sizes of each shape, and the report files.

The orchestrator (`run.py`) runs each phase as its own process with a time limit; a phase
writes its report file as it ends (`write_report`, atomically), so a run cut short still reports
what finished. Only the standard library here: the orchestrator imports this module before the
bundle's wheels are on the path.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SERVED_NAME = "gpu-check"

# Every file a run writes into the report directory (the device machine returns at most 8).
REPORT_FILES = ("env.json", "kernels.json", "quant.json", "parity.json", "serve.json", "shard-tests.json",
                "stack.log", "summary.json")


@dataclass(frozen=True)
class Profile:
    """The sizes of one shape's run. `shape` names a `bench_model.SHAPES` entry or one of
    `EXTRA_SHAPES` (model dimensions and dtype live there)."""

    shape: str
    adapters: int  # written and served (ranks alternate 8 and 16)
    parity_adapters: int  # of them, compared with peft
    parity_prompt_tokens: tuple[int, ...]
    parity_new_tokens: int
    streams: tuple[int, ...]
    prompt_tokens: int  # load phase
    max_tokens: int  # load phase
    requests_per_client: int
    # Longest request the stack admits: parity's longest prompt + new tokens, and the load's.
    max_total_tokens: int
    # Per phase: most seconds it may run (the run's budget may leave less).
    timeouts: dict[str, float]
    shard_tests: tuple[str, ...]  # pytest arguments (files, -k ...)
    # Paged decode attention cases: (sequences, context tokens).
    attention_cases: tuple[tuple[int, int], ...]
    lora_cases: str  # "llama3-8b" or "quick": which LoRA kernel cases (phase_kernels.py)
    stack_start_s: float


# The shard test files that honour QUIVER_TEST_DEVICE, and the Triton kernels' tests (compiled for
# the device there; under the interpreter on CPU); the kernels' newer test files are added by
# pattern (phase_shard_tests.py globs SHARD_TEST_GLOBS). Tests named for the CPU are left out:
# they would build the C++ kernels, which the GPU machine has no use for.
GPU_SHARD_TESTS = (
    "server/tests/test_model_parity.py",
    "server/tests/test_model_parity_16bit.py",
    "server/tests/test_family_adapters.py",
    "server/tests/test_moe_grouped.py",
    "server/tests/test_lora_kernels.py",
    "server/tests/test_engine_device.py",
    "server/tests/test_kv_cache_dtype.py",
    "-k", "not cpu",
)
SHARD_TEST_GLOBS = ("test_*triton*.py", "test_*paged*.py", "test_*attention*.py", "test_*graph*.py",
                    "test_*cuda*.py")

PROFILES = {
    "llama3-8b": Profile(
        shape="llama3-8b",
        adapters=32,
        parity_adapters=3,
        parity_prompt_tokens=(7, 33, 90, 250),
        parity_new_tokens=16,
        streams=(32, 128),
        prompt_tokens=128,
        max_tokens=128,
        requests_per_client=1,
        max_total_tokens=512,
        timeouts={"env": 60, "kernels": 75, "quant": 150, "model": 150, "stack": 240, "shard-tests": 180},
        shard_tests=GPU_SHARD_TESTS,
        attention_cases=((32, 1024), (32, 4096), (128, 1024), (8, 16384)),
        lora_cases="llama3-8b",
        stack_start_s=150,
    ),
    "tiny": Profile(
        shape="tiny",
        adapters=4,
        parity_adapters=2,
        parity_prompt_tokens=(5, 19),
        parity_new_tokens=8,
        streams=(2, 4),
        prompt_tokens=16,
        max_tokens=8,
        requests_per_client=1,
        max_total_tokens=64,
        timeouts={"env": 60, "kernels": 90, "quant": 90, "model": 90, "stack": 120, "shard-tests": 90},
        # Fast and device-honouring: the CI smoke run proves the phase's plumbing, not the suite.
        shard_tests=("server/tests/test_engine_device.py", "server/tests/test_model_parity.py", "-k",
                     "engine_device or (llama and not 16)"),
        attention_cases=((3, 40), (2, 100)),
        lora_cases="quick",
        stack_start_s=90,
    ),
}
# The stack first: the whole server on the device is what a run must not miss; the kernel figures
# and the shard tests after it, the shard tests last with what the budget leaves.
PHASES = ("env", "model", "stack", "kernels", "quant", "shard-tests")


@dataclass
class Options:
    """One run: written by the orchestrator into `work_dir/options.json`, read by every phase."""

    profile: Profile
    device: str
    report_dir: str
    work_dir: str
    bundle: str | None = None
    bin_dir: str | None = None  # the launcher, router and quiver-server shim (None: .venv/bin)
    # What the orchestrator prepared (wheels installed, pb modules copied), for env.json.
    prepared: dict[str, Any] = field(default_factory=dict)
    # Seconds this phase may run (set per phase by the orchestrator).
    phase_timeout_s: float = 0.0

    @property
    def work(self) -> Path:
        return Path(self.work_dir)

    @property
    def reference_path(self) -> Path:
        """What the model phase leaves the stack phase: model dir, adapter ids, reference tokens."""
        return self.work / "reference.json"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Options:
        raw = json.loads(path.read_text())
        profile = raw.pop("profile")
        for key in ("parity_prompt_tokens", "streams", "shard_tests"):
            profile[key] = tuple(profile[key])
        profile["attention_cases"] = tuple(tuple(case) for case in profile["attention_cases"])
        return cls(profile=Profile(**profile), **raw)


def phase_options() -> Options:
    """The options of the phase script now running (its one argument)."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OPTIONS_JSON (run by bench.gpu_check.run)")
    return Options.load(Path(sys.argv[1]))


def write_report(options: Options, name: str, data: Any) -> Path:
    """Writes one report file atomically (a reader never sees half of it)."""
    assert name in REPORT_FILES, name
    path = Path(options.report_dir) / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)
