"""GGUF to `save_pretrained` files, with transformers' own GGUF loader (and the `gguf` package):
the quantized blocks are expanded to float32 exactly (each Q4_1 weight is scale × q + min), the
tokenizer and chat template come from the GGUF's metadata. What is written loads in stock
transformers as any Hub checkpoint does, so tests and users can compare against it directly."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def dequantize_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Progress goes to our log as stages; tqdm's carriage-return bars would garble it.
    hf_logging.disable_progress_bar()
    logger.info("demo model: reading the tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("demo model: dequantizing the GGUF's tensors to float32 (about half a minute)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model remembers it came from a GGUF and refuses to save; its weights are plain
    # float32 tensors now, so it is saved as the unquantized checkpoint it has become.
    del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    logger.info("demo model: writing %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
