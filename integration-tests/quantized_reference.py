"""The reference for a base served with `--quantize`: the same checkpoint with every projection
weight replaced by its quantized-then-dequantized value, derived here from the documented rules
(docs/quantization.md), written with `save_pretrained` for transformers and peft to run:

- int8: one symmetric scale per output channel, scale = max|w| / 127 (float32), q = round(w / scale);
- int4: groups of 32 inputs (the default group; else the whole row),
  scale = (max - min) / 15 (float32), offset = min, q = round((w - min) / scale) in [0, 15].
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _group(width: int) -> int:
    return 32 if width % 32 == 0 else width


def dequantized(w: torch.Tensor, method: str) -> torch.Tensor:
    w64 = w.double()
    if method == "int8":
        scale = (w64.abs().amax(dim=1, keepdim=True) / 127).float().double()
        return (torch.round(w64 / scale).clamp(-127, 127) * scale).float()
    out, width = w.shape
    group = _group(width)
    g = w64.view(out, width // group, group)
    low, high = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = ((high - low).float() / 15).double()
    return (torch.round((g - low) / scale).clamp(0, 15) * scale + low).float().view(out, width)


def write_dequantized(base_dir: Path, out_dir: Path, method: str) -> Path:
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                param.copy_(dequantized(param, method))
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir
