"""adapter_config.json as PEFT writes it, and which of our modules it targets.

Only plain LoRA is served: the delta scaling * B @ A added to a linear projection's output.
Every PEFT option that changes that computation (DoRA, LoRA biases, trained copies of whole
modules, embedding targets, per-module rank/alpha patterns, ...) is refused with a ValueError
that names it, rather than served wrongly. Options that only matter for training (dropout,
init schemes) are ignored.

Target matching replicates PEFT's `check_target_module_exists`: a string is a regex that must
match a whole module path; a list entry matches a path equal to it or ending in "." + entry;
`layers_to_transform` (list targets only, as in PEFT) keeps the given layer indices;
`exclude_modules` removes matches; "all-linear" means every linear layer but the output head.
`target_parameters` entries match parameter paths (model.layers.0.mlp.experts.gate_up_proj) the
way PEFT's `_inject_parameters` does: equal, or ending in "." + entry. `rank_pattern` and
`alpha_pattern` give matching modules (or parameters) their own rank and alpha, PEFT's
`get_pattern_key` deciding which key applies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver_server.adapters.confined import read_confined
from quiver_server.adapters.size_limits import OTHER_FILES
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.bounded_text import clipped, listed, shown

CONFIG_FILE = "adapter_config.json"
ALL_LINEAR = "all-linear"


def _set(value: Any) -> bool:
    return value not in (None, False, "", [], {}, 0)


# adapter_config.json key -> (is the value one we cannot serve?, why).
UNSUPPORTED_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_dora": (_set, "DoRA (use_dora) is not supported"),
    "modules_to_save": (_set, "modules_to_save (fully trained copies of {value}) is not supported"),
    "bias": (lambda v: v not in (None, "none"), 'bias={value} is not supported (only "none")'),
    "lora_bias": (_set, "lora_bias (a bias on lora_B) is not supported"),
    "fan_in_fan_out": (_set, "fan_in_fan_out (Conv1D-style weights) is not supported"),
    "trainable_token_indices": (_set, "trainable_token_indices (embedding rows) is not supported"),
    "layer_replication": (_set, "layer_replication is not supported"),
    "alora_invocation_tokens": (_set, "activated LoRA (alora_invocation_tokens) is not supported"),
    "use_qalora": (_set, "QA-LoRA (use_qalora) is not supported"),
    "use_bdlora": (_set, "block-diagonal LoRA (use_bdlora) is not supported"),
    "arrow_config": (_set, "Arrow routing (arrow_config) is not supported"),
    "kasa_config": (_set, "KaSA (kasa_config) is not supported"),
    "velora_config": (_set, "VeLoRA (velora_config) is not supported"),
    "monteclora_config": (_set, "MonteCLoRA (monteclora_config) is not supported"),
}


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]  # a regex, or names / path suffixes; () with target_parameters only
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    exclude_modules: str | tuple[str, ...] | None
    base_model_name_or_path: str | None
    target_parameters: tuple[str, ...] = ()  # parameter paths or their suffixes (MoE experts, routers)
    rank_pattern: tuple[tuple[str, int], ...] = ()  # (regex, r) in the file's order
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def scaling(self) -> float:
        """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self._scaling(self.rank, self.alpha)

    def _scaling(self, rank: int, alpha: float) -> float:
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def rank_for(self, key: str) -> int:
        """The rank PEFT gives module (or parameter) path `key`."""
        return _pattern_value(self.rank_pattern, key, self.rank)

    def scaling_for(self, key: str) -> float:
        """The scaling PEFT gives module (or parameter) path `key`."""
        return self._scaling(self.rank_for(key), _pattern_value(self.alpha_pattern, key, self.alpha))

    @property
    def max_rank(self) -> int:
        return max([self.rank, *(rank for _, rank in self.rank_pattern)])


def _pattern_value(patterns: tuple[tuple[str, Any], ...], key: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the first pattern p with `(.*\\.)?(p)$` matching the key."""
    for pattern, value in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _pattern(raw: Any, key: str, kind: type) -> tuple[tuple[str, Any], ...]:
    if raw in (None, {}):
        return ()
    numbers = (int,) if kind is int else (int, float)
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, numbers) and not isinstance(v, bool) and v > 0 for k, v in raw.items()
    ):
        raise ValueError(f"{CONFIG_FILE}: {key} must map module patterns to positive numbers, got {shown(raw)}")
    return tuple((_regex(k, key), int(v) if kind is int else _float(v, key)) for k, v in raw.items())


def _regex(pattern: str, key: str) -> str:
    """`pattern`, which PEFT uses as a regular expression: a ValueError (400) if it is not one,
    rather than re.error when the targets are resolved (500)."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"{CONFIG_FILE}: {key} {shown(pattern)} is not a regular expression ({error.msg})") from None
    return pattern


def _float(value: int | float, key: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"{CONFIG_FILE}: {key} is out of range, got {shown(value)}") from None


def _names(value: Any, key: str) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"{CONFIG_FILE}: {key} must be a string or a list of strings, got {shown(value)}")


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def parse_lora_config(raw: dict[str, Any]) -> LoraConfig:
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {clipped(peft_type)} is not supported (only LORA)")
    problems = [
        why.format(value=shown(raw[key]))
        for key, (unsupported, why) in UNSUPPORTED_OPTIONS.items()
        if key in raw and unsupported(raw[key])
    ]
    if problems:
        raise ValueError(f"{CONFIG_FILE}: " + "; ".join(problems))
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{CONFIG_FILE}: r must be a positive integer, got {shown(rank)}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha must be a number, got {shown(alpha)}")
    targets = _names(raw.get("target_modules"), "target_modules") or ()
    if isinstance(targets, str):
        _regex(targets, "target_modules")
    parameters = _names(raw.get("target_parameters"), "target_parameters") or ()
    if isinstance(parameters, str):
        parameters = (parameters,)
    if not targets and not parameters:
        raise ValueError(f"{CONFIG_FILE}: target_modules is empty")
    layers = raw.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise ValueError(f"{CONFIG_FILE}: layers_to_transform must be an int or a list of ints, got {shown(layers)}")
    pattern = _names(raw.get("layers_pattern"), "layers_pattern")
    for entry in (pattern,) if isinstance(pattern, str) else pattern or ():
        _regex(entry, "layers_pattern")
    excluded = _names(raw.get("exclude_modules"), "exclude_modules")
    if isinstance(excluded, str):
        _regex(excluded, "exclude_modules")
    return LoraConfig(
        rank=rank,
        alpha=_float(alpha, "lora_alpha"),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=targets,
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=(pattern,) if isinstance(pattern, str) else pattern,
        exclude_modules=excluded,
        # Only a hint (validation.py reads it when it is a local directory): not a string, no hint.
        base_model_name_or_path=_text_or_none(raw.get("base_model_name_or_path")),
        target_parameters=parameters,
        rank_pattern=_pattern(raw.get("rank_pattern"), "rank_pattern", int),
        alpha_pattern=_pattern(raw.get("alpha_pattern"), "alpha_pattern", float),
    )


def read_lora_config(adapter_dir: Path, root: Path | None = None) -> LoraConfig:
    """adapter_config.json of `adapter_dir`, read only if it resolves inside `root` (default: the directory)."""
    adapter_dir = Path(adapter_dir)
    text = read_confined(adapter_dir, CONFIG_FILE, root or adapter_dir.resolve(), OTHER_FILES)
    if text is None:
        raise ValueError(f"the adapter directory has no {CONFIG_FILE}: it is not a PEFT adapter directory")
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        # The decoder's line/column would be shown to the client: the file's name is enough.
        raise ValueError(f"{CONFIG_FILE} is not valid JSON") from None
    except RecursionError:
        # Python's decoder recurses once per level: a file nested deeper than the interpreter's
        # stack is a malformed adapter (400), not a shard failure.
        raise ValueError(f"{CONFIG_FILE} is nested too deeply to be an adapter config") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
    return parse_lora_config(raw)


# ---- target resolution ---------------------------------------------------------------------


def _matches_name(names: tuple[str, ...], key: str) -> bool:
    return any(key == name or key.endswith(f".{name}") for name in names)


def _excluded(config: LoraConfig, key: str) -> bool:
    excluded = config.exclude_modules
    if not excluded:
        return False
    if isinstance(excluded, str):
        return re.fullmatch(excluded, key) is not None
    return _matches_name(excluded, key)


def _in_layers(config: LoraConfig, key: str) -> bool:
    """PEFT's layers_to_transform filter: the first number after a `layers_pattern` segment
    (any segment if no pattern) is the layer index."""
    if config.layers_to_transform is None:
        return True
    if config.layers_pattern:
        found = (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key) for p in config.layers_pattern)
        match = next((m for m in found if m is not None), None)
    else:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    return match is not None and int(match["idx"]) in config.layers_to_transform


def _targets(config: LoraConfig, key: str, entry: str | None) -> bool:
    """Whether PEFT would put LoRA on module `key`; `entry` narrows a list to one item."""
    if _excluded(config, key):
        return False
    if isinstance(config.target_modules, str):
        return re.fullmatch(config.target_modules, key) is not None
    names = config.target_modules if entry is None else (entry,)
    return _matches_name(names, key) and _in_layers(config, key)


def resolve_targets(config: LoraConfig, spec: BaseModelSpec) -> set[tuple[int, str]]:
    """(layer, projection) pairs the adapter applies to in our model. A target that names a
    module we cannot serve LoRA on, or no module of this model at all, is a ValueError."""
    targets = _module_targets(config, spec) if config.target_modules else set()
    targets |= parameter_targets(config, spec)
    if not targets:
        raise ValueError(
            f"target_modules {_show(config.target_modules)} match none of this {spec.model_type} "
            f"model's LoRA-capable modules ({' '.join(spec.projections)})"
        )
    return targets


def _module_targets(config: LoraConfig, spec: BaseModelSpec) -> set[tuple[int, str]]:
    servable = spec.module_paths()
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        return {where for key, where in servable.items() if not _excluded(config, key)}

    unservable = [key for key in spec.non_lora_modules if _targets(config, key, None)]
    if unservable:
        supported = " ".join(spec.projections)
        raise ValueError(
            f"target_modules {_show(config.target_modules)} includes {', '.join(unservable)}: LoRA on "
            f"embeddings or the output head is not supported (only on {supported})"
        )
    if isinstance(config.target_modules, tuple):
        unknown = [
            entry
            for entry in config.target_modules
            if not any(_targets(config, key, entry) for key in servable)
        ]
        if unknown:
            raise ValueError(
                f"target_modules {listed(unknown)} match none of this {spec.model_type} "
                f"model's LoRA-capable modules ({' '.join(spec.projections)} in layers "
                f"0..{spec.num_layers - 1})"
            )
    return {where for key, where in servable.items() if _targets(config, key, None)}


def targeted_parameters(config: LoraConfig, spec: BaseModelSpec) -> dict[str, tuple[int, tuple[str, ...]]]:
    """The parameter paths `target_parameters` names (PEFT: equal, or ending in "." + entry) ->
    (layer, the projections each holds); an entry naming none of them is a ValueError."""
    if not config.target_parameters:
        return {}
    paths = spec.parameter_paths()
    matched = {}
    for entry in config.target_parameters:
        found = {path: where for path, where in paths.items() if path == entry or path.endswith(f".{entry}")}
        if not found:
            raise ValueError(
                f"target_parameters {shown(entry)} matches none of this {spec.model_type} model's parameters that take "
                "LoRA (each projection's weight; a sparse MLP's experts.gate_up_proj and experts.down_proj)"
            )
        matched.update(found)
    return matched


def parameter_targets(config: LoraConfig, spec: BaseModelSpec) -> set[tuple[int, str]]:
    return {(layer, name) for layer, names in targeted_parameters(config, spec).values() for name in names}


def _show(targets: str | tuple[str, ...]) -> str:
    return shown(targets) if isinstance(targets, str) else f"[{listed(targets)}]"
