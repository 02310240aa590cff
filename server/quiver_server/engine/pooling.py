"""How an embedding is pooled from a model's last hidden states.

A model that ships sentence-transformers files (`modules.json` naming a Pooling module, and
maybe a Normalize one) is pooled as sentence-transformers pools it. Any other model is pooled
as vLLM pools a causal LM by default: the last token's hidden state, L2-normalized. A pipeline
with a module the shard does not apply (a Dense projection, say) cannot be served exactly, so
its embeddings are refused with the reason rather than computed without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

# sentence-transformers' Pooling config: its `pooling_mode` names (releases from 6 on) and the
# flags older releases wrote, -> our mode names.
_MODE_NAMES = {
    "cls": "cls",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weighted_mean",
    "lasttoken": "last",
}
_MODE_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weighted_mean",
    "pooling_mode_lasttoken": "last",
}
# Module classes by their last name: the package path differs between releases
# (`sentence_transformers.models.Pooling`, `...sentence_transformer.modules.pooling.Pooling`).
_APPLIED = {"Transformer", "Pooling", "Normalize"}


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of _MODE_NAMES' values
    normalize: bool  # L2-normalize the pooled vector
    source: str  # where the choice came from, for the log and /info
    refusal: str = ""  # non-empty: embeddings are refused, for this reason

    def describe(self) -> str:
        if self.refusal:
            return f"none ({self.refusal})"
        return f"{self.mode}{', L2-normalized' if self.normalize else ''} ({self.source})"


DEFAULT = Pooling("last", True, "default for a causal LM")


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling `model_dir`'s sentence-transformers files ask for, else `DEFAULT`."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return DEFAULT
    try:
        modules = [(str(m["type"]), str(m.get("path", ""))) for m in json.loads(modules_file.read_text())]
    except (ValueError, KeyError, TypeError) as error:
        return _refused(f"modules.json cannot be read: {error}")
    kinds = [module_type.rsplit(".", 1)[-1] for module_type, _ in modules]
    others = [module_type for (module_type, _), kind in zip(modules, kinds, strict=True) if kind not in _APPLIED]
    if others:
        return _refused(f"its sentence-transformers pipeline has modules quiver does not apply: {', '.join(others)}")
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return Pooling("last", normalize, "sentence-transformers files without a Pooling module")
    config_file = model_dir / modules[kinds.index("Pooling")][1] / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        return _refused(f"the Pooling module's config.json cannot be read: {error}")
    modes = _pooling_modes(config)
    if len(modes) != 1 or modes[0] is None:
        return _refused(f"its Pooling module asks for {config.get('pooling_mode', modes)!r}; quiver applies "
                        f"exactly one of {', '.join(_MODE_NAMES)}")
    if config.get("include_prompt", True) is False:
        return _refused("its Pooling module excludes the prompt (include_prompt: false)")
    return Pooling(modes[0], normalize, "sentence-transformers")


def _pooling_modes(config: dict) -> list[str | None]:
    """The modes a Pooling config asks for: `pooling_mode` (a name or a list) where present,
    else the flags set; no flag means mean, as sentence-transformers reads it."""
    named = config.get("pooling_mode")
    if named is not None:
        names = named if isinstance(named, list) else [named]
        return [_MODE_NAMES.get(str(name)) for name in names]
    flagged = [mode for flag, mode in _MODE_FLAGS.items() if config.get(flag)]
    return list(flagged) if flagged else ["mean"]


def _refused(reason: str) -> Pooling:
    return Pooling("", False, "sentence-transformers", reason)


def pool(hidden: torch.Tensor, lengths: list[int], pooling: Pooling) -> list[list[float]]:
    """hidden [sum(lengths), H]: the sequences' tokens side by side -> one float32 vector per
    sequence, pooled as `pooling` says."""
    vectors = []
    start = 0
    for length in lengths:
        tokens = hidden[start : start + length].float()
        start += length
        vectors.append(_pool_one(tokens, pooling.mode))
    pooled = torch.stack(vectors)
    if pooling.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
    return pooled.tolist()


def _pool_one(tokens: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "last":
        return tokens[-1]
    if mode == "cls":
        return tokens[0]
    if mode == "mean":
        return tokens.mean(0)
    if mode == "max":
        return tokens.max(0).values
    if mode == "mean_sqrt_len":
        return tokens.sum(0) / math.sqrt(tokens.shape[0])
    if mode == "weighted_mean":  # the i-th token (1-based) weighs i
        weights = torch.arange(1, tokens.shape[0] + 1, dtype=tokens.dtype, device=tokens.device)
        return (tokens * weights[:, None]).sum(0) / weights.sum()
    raise ValueError(f"unknown pooling mode {mode!r}")
