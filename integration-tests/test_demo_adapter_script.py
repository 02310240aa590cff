"""demo/train_adapter.py, the script that made the shipped demo adapter, run briefly on the demo
model the launcher wrote: what it writes has the shipped adapter's configuration, tensors and
shapes, loads in peft, and two runs with the same seed write the same bytes (the script is
reproducible on one machine; the shipped adapter is its full-length run)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import peft
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from stack import REPO_ROOT, VENV_BIN

SCRIPT = REPO_ROOT / "demo" / "train_adapter.py"
STEPS = 2


def _train(demo, out: Path) -> None:
    run = subprocess.run([str(VENV_BIN / "python"), str(SCRIPT), "--base", str(demo.model_dir), "--out", str(out),
                          "--max-steps", str(STEPS)], capture_output=True, text=True, timeout=600,
                         env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]


def _tensors(adapter: Path) -> dict[str, tuple[tuple[int, ...], bytes]]:
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as file:
        return {key: (tuple(file.get_tensor(key).shape), file.get_tensor(key).numpy().tobytes())
                for key in file.keys()}


def test_the_script_writes_the_shipped_kind_of_adapter_reproducibly(demo, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _train(demo, first)
    _train(demo, second)
    shipped = demo.adapter_dir
    config = json.loads((first / "adapter_config.json").read_text())
    assert config == json.loads((shipped / "adapter_config.json").read_text())
    trained, reference = _tensors(first), _tensors(shipped)
    assert {k: shape for k, (shape, _) in trained.items()} == {k: shape for k, (shape, _) in reference.items()}
    assert trained != reference, f"{STEPS} steps cannot have made the shipped adapter"
    assert trained == _tensors(second), "two runs with one seed differ"
    assert (first / "README.md").read_text().startswith("# quiver-demo-pirate")
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir)
    peft.PeftModel.from_pretrained(base, first)
