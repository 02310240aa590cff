"""Adapters whose own files would flood the error path (issue 48): a refusal that quoted them
whole once broke the router's HTTP/2 connection to its shard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reliability_checks import MAX_MESSAGE_BYTES

__all__ = ["HOSTILE_MODULES", "MAX_MESSAGE_BYTES", "hostile_copy"]

# 200 module names of 100 characters: a refusal quoting them is longer than an HTTP/2 trailer
# may be by default (16 KiB).
HOSTILE_MODULES = [f"m{i:05d}" + "x" * 94 for i in range(200)]


def hostile_copy(source: Path, target: Path) -> Path:
    """`source`'s adapter with HOSTILE_MODULES as its target modules, written to `target`."""
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config["target_modules"] = HOSTILE_MODULES
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target
