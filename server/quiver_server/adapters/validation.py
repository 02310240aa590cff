"""Checks an adapter against the base model before any of it reaches a device slot.

A mismatch is a ValueError that says what differs (the router shows it to the client as a 400):
the base the adapter was trained on (when adapter_config.json points at a local copy of it),
every A/B shape against the projection it adds to, the rank against the slots' capacity, and
that the weight file covers exactly the modules target_modules names — an adapter is applied
completely or not at all, never with a target silently skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quiver_server.adapters.peft_config import LoraConfig
from quiver_server.adapters.peft_keys import LoraWeights
from quiver_server.adapters.spec import SHAPE_KEYS, BaseModelSpec

MAX_LISTED = 4  # problems spelled out in one message; the rest are counted


def _base_config_hint(config: LoraConfig) -> tuple[str, dict[str, Any]] | None:
    """config.json of the base the adapter was trained on, when it names a local directory."""
    if not config.base_model_name_or_path:
        return None
    path = Path(config.base_model_name_or_path).expanduser() / "config.json"
    try:
        if path.is_file():
            hint = json.loads(path.read_text())
            return (config.base_model_name_or_path, hint) if isinstance(hint, dict) else None
    except (OSError, ValueError):
        pass  # an unreadable hint proves nothing; the shape checks still run
    return None


def _base_problems(config: LoraConfig, spec: BaseModelSpec) -> list[str]:
    hint = _base_config_hint(config)
    if hint is None:
        return []
    _, trained_on = hint
    return [
        # Not named: it is a local path on this server (clients see the message).
        f"the model it was made for has {key}={trained_on[key]!r}, this model has {spec.config.get(key)!r}"
        for key in SHAPE_KEYS
        if key in trained_on and key in spec.config and trained_on[key] != spec.config[key]
    ]


def _shape_problems(weights: LoraWeights, spec: BaseModelSpec) -> list[str]:
    problems: list[str] = []
    reported: set[tuple[str, str]] = set()  # one line per projection and half, not per layer
    for (_, name), weight in weights.items():
        projection = spec.projections[name]
        path, rank = weight.path, weight.rank
        experts = (projection.experts,) if projection.experts > 1 else ()
        expected = {
            "lora_A": ((*experts, rank, projection.in_features), f"{name} takes {projection.in_features} inputs"),
            "lora_B": ((*experts, projection.out_features, rank), f"{name} has {projection.out_features} outputs"),
        }
        for half, tensor in (("lora_A", weight.a), ("lora_B", weight.b)):
            shape, why = expected[half]
            if (name, half) in reported:
                continue
            if not tensor.is_floating_point():
                problems.append(f"{path}.{half} has dtype {tensor.dtype}, not a floating-point type")
            elif tuple(tensor.shape) != shape:
                problems.append(
                    f"{path}.{half} has shape {tuple(tensor.shape)}, the base needs {shape} "
                    f"(r={rank}; the base's {why})"
                )
            else:
                continue
            reported.add((name, half))
    return problems


def check_adapter(
    config: LoraConfig,
    targets: set[tuple[int, str]],
    weights: LoraWeights,
    spec: BaseModelSpec,
    max_rank: int,
    file_name: str,
) -> None:
    """Raises one ValueError listing every way the adapter does not fit the base."""
    problems = _base_problems(config, spec)
    rank = max([0, *(weight.rank for weight in weights.values())])
    if rank > max_rank:
        problems.append(f"rank r={rank} exceeds the largest rank a slot holds (max_lora_rank={max_rank})")
    missing = sorted(targets - weights.keys())
    if missing:
        names = ", ".join(spec.module_path(*where) for where in missing[:MAX_LISTED])
        more = f" and {len(missing) - MAX_LISTED} more" if len(missing) > MAX_LISTED else ""
        problems.append(f"{file_name} has no LoRA weights for targeted modules {names}{more}")
    extra = sorted(weights.keys() - targets)
    if extra:
        names = ", ".join(spec.module_path(*where) for where in extra[:MAX_LISTED])
        more = f" and {len(extra) - MAX_LISTED} more" if len(extra) > MAX_LISTED else ""
        problems.append(f"{file_name} has LoRA weights for {names}{more}, which target_modules does not name")
    problems += _shape_problems(weights, spec)
    if problems:
        shown = problems[:MAX_LISTED]
        if len(problems) > MAX_LISTED:
            shown.append(f"and {len(problems) - MAX_LISTED} more problems")
        raise ValueError("adapter does not fit the base model: " + "; ".join(shown))
