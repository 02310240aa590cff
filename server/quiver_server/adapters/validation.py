"""Checks an adapter against the base model before any of it reaches a device slot.

A mismatch is a ValueError that says what differs (the router shows it to the client as a 400):
the base the adapter was trained on (when adapter_config.json points at a copy of it inside the
adapter root),
every A/B shape against the projection it adds to, the rank against the slots' capacity, and
that the weight file covers exactly the modules target_modules names — an adapter is applied
completely or not at all, never with a target silently skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quiver_server.adapters.confined import is_inside, read_confined
from quiver_server.adapters.peft_config import LoraConfig
from quiver_server.adapters.peft_keys import LoraWeights
from quiver_server.adapters.size_limits import MIB, SizeLimit
from quiver_server.adapters.spec import SHAPE_KEYS, BaseModelSpec
from quiver_server.bounded_text import shown

MAX_LISTED = 4  # problems spelled out in one message; the rest are counted
# A model's config.json is a few KiB; a bigger one is no base's and is not read for the hint.
HINT_LIMIT = SizeLimit(MIB, "more than a base model's config may be")


def _base_config_hint(config: LoraConfig, root: Path | None) -> dict[str, Any] | None:
    """config.json of the base the adapter was trained on, when it names a directory inside `root`.

    The name is the adapter's say-so, and the refusal echoes what it finds: read anywhere, it would
    let a client's adapter probe the server's files. So only an absolute path that resolves (links
    followed) inside the adapter root counts; a relative name (a hub id, resolved against the
    shard's working directory) or `~` never does, and without an adapter root there is no hint.
    """
    name = config.base_model_name_or_path
    if root is None or not name or not Path(name).is_absolute():
        return None
    try:
        directory = Path(name).resolve()
        if not is_inside(directory, root):
            return None
        # Checked again where the opened file really is, and its size before it is read.
        data = read_confined(directory, "config.json", root, HINT_LIMIT)
        hint = json.loads(data) if data is not None else None
    except (OSError, ValueError, RuntimeError, RecursionError):  # RuntimeError: a symlink loop
        return None  # an unreadable hint proves nothing; the shape checks still run
    return hint if isinstance(hint, dict) else None


def _base_problems(config: LoraConfig, spec: BaseModelSpec, root: Path | None) -> list[str]:
    trained_on = _base_config_hint(config, root)
    if trained_on is None:
        return []
    return [
        # Not named: it is a local path on this server (clients see the message).
        f"the model it was made for has {key}={shown(trained_on[key])}, this model has {shown(spec.config.get(key))}"
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
    hint_root: Path | None = None,
) -> None:
    """Raises one ValueError listing every way the adapter does not fit the base. `hint_root`:
    the canonical adapter root, the only place the base's config.json is read from (`_base_config_hint`)."""
    problems = _base_problems(config, spec, hint_root)
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
