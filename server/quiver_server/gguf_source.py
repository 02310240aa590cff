"""Serving a GGUF file (`--model-id model.gguf`) in its own quantization.

The router and the shard both read a model *directory* (config.json, tokenizer files, chat
template); a GGUF file carries all of that in its metadata. So the first start writes a small
companion directory — config.json, generation_config.json and the tokenizer with its chat
template, as transformers' GGUF reader derives them — plus `gguf-source.json` naming the file,
and serves that directory: the weights themselves are read from the GGUF (`weights.iter_tensors`
follows the pointer), quantized projections staying quantized (`quant.gguf_model`).

The companion lives under $QUIVER_CACHE_DIR (default ~/.cache/quiver)/gguf/, keyed by the file's
absolute path, size and modification time, so a changed file gets a new one and an unchanged
one starts without re-reading its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf-source.json"


def is_gguf_file(model_id: str) -> bool:
    path = Path(model_id).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def cache_root() -> Path:
    return Path(os.environ.get("QUIVER_CACHE_DIR", "~/.cache/quiver")).expanduser() / "gguf"


# Bumped when the companion's contents change meaning (2: Llama 3.1+ rope scaling read from the
# file's rope_freqs into config.json), so a companion an older quiver wrote is not reused.
COMPANION_VERSION = 2


def _key(gguf: Path) -> str:
    stat = gguf.stat()
    identity = f"{gguf}\n{stat.st_size}\n{stat.st_mtime_ns}\n{COMPANION_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{gguf.stem}-{digest}"


def prepare(model_id: str) -> str:
    """The companion directory of GGUF file `model_id`, written on first use."""
    gguf = Path(model_id).expanduser().resolve()
    target = cache_root() / _key(gguf)
    if (target / SOURCE_FILE).is_file():
        return str(target)
    from quiver_server.quant.gguf_model import gguf_config

    logger.info("GGUF %s: writing its config and tokenizer into %s (first start only)", gguf.name, target)
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config = gguf_config(gguf)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(gguf, staging)
    _write_generation_config(config, staging)
    # Last: its presence marks the directory complete.
    (staging / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf)}))
    try:
        staging.rename(target)
    except OSError:  # another shard of this server wrote it first
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _write_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def _write_generation_config(config: dict, out: Path) -> None:
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if config.get(key) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def source_of(model_dir: Path) -> Path | None:
    """The GGUF file a companion directory stands for, or None for a plain checkpoint."""
    pointer = Path(model_dir) / SOURCE_FILE
    if not pointer.is_file():
        return None
    return Path(json.loads(pointer.read_text())["gguf"])
