"""The benchmark's LoRA adapters: random weights, written by `peft` itself, in one adapter root.

    ids = ensure_adapters(model_dir, root, count=32, dtype="float32")  # ["a00-r8", "a01-r16", ...]

Ranks alternate 8 and 16 (even index rank 8, odd rank 16), every adapter targets all seven
projections (q, k, v, o, gate, up, down) with lora_alpha = r, unless the caller names other
`target_modules` (peft's own spelling: a list, or "all-linear", which on a sparse model also
wraps the router and the fused experts through `target_parameters`). PEFT initialises lora_B
to zero — an untrained adapter that changes nothing and whose work a server could skip — so
both A and B are drawn at random here.

The PeftModel is built over a base model on the meta device: PEFT needs only the module tree
to name and shape the LoRA weights, so a 7B shape costs no memory and no time to build. The
random LoRA tensors are then assigned in and `save_pretrained` writes the files, as PEFT
writes every adapter (adapter_config.json + adapter_model.safetensors).

Adapters are written once per (model, count, ranks) and reused by later runs; the ids are
directory names inside the root, served with `--adapter-source local --adapter-root ROOT`.

`ensure_fleet` writes many adapters of mixed ranks (the fleet block, fleet_bench.py): one meta
PeftModel per rank writes its first adapter with `save_pretrained`, and every later adapter of
that rank gets the same config and the same tensor names and shapes, with fresh random values,
saved straight with safetensors rather than through a `save_pretrained` per adapter (1,000
adapters of the CPU shape, 3.6 GB in bfloat16, take about 45 s to write on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RANKS = (8, 16)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCALE = 0.1  # of lora_B: a visible change to the logits, nowhere near overflow in bfloat16


def rank_of(index: int) -> int:
    return RANKS[index % len(RANKS)]


def adapter_id(index: int) -> str:
    return f"a{index:02d}-r{rank_of(index)}"


def ids(count: int) -> list[str]:
    return [adapter_id(i) for i in range(count)]


def _lora_config(rank: int, model_dir: Path, target_modules: list[str] | str):
    import peft

    return peft.LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=rank, lora_dropout=0.0,
                           target_modules=target_modules, base_model_name_or_path=str(model_dir))


def _meta_peft_model(model_dir: Path, rank: int, dtype: torch.dtype, target_modules: list[str] | str):
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return peft.get_peft_model(base, _lora_config(rank, model_dir, target_modules))


def _randomise(model, generator: torch.Generator, dtype: torch.dtype) -> None:
    """Replaces every LoRA weight (on meta) by a real random tensor: A [r, in] with unit-variance
    rank components, B [out, r] at SCALE."""
    for module in model.modules():
        for part in ("lora_A", "lora_B"):
            holder = getattr(module, part, None)
            if not isinstance(holder, torch.nn.ModuleDict):
                continue
            for linear in holder.values():
                assert isinstance(linear, torch.nn.Linear), linear
                out_features, in_features = linear.weight.shape
                weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5
                if part == "lora_B":
                    weight *= SCALE
                linear.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)


def _marker(model_dir: Path, dtype: str, seed: int, target_modules: list[str] | str) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return {"model": str(model_dir), "model_config": config, "ranks": list(RANKS),
            "target_modules": target_modules, "scale": SCALE, "dtype": dtype, "seed": seed}


def _written(marker_path: Path, marker: dict) -> int:
    """How many adapters of this exact recipe the root already holds (0: none, or another recipe)."""
    if not marker_path.exists():
        return 0
    written = json.loads(marker_path.read_text())
    count = written.pop("count", 0)
    return count if written == marker else 0


def ensure_adapters(model_dir: Path, root: Path, count: int, dtype: str, seed: int = 0,
                    target_modules: list[str] | str = TARGET_MODULES) -> list[str]:
    """Writes `count` adapters for the model in `model_dir` under `root` (once) and returns their
    ids, in order: request i of a scenario with n adapters goes to ids[i % n]."""
    model_dir = model_dir.resolve()
    marker_path = root / "bench-adapters.json"
    marker = _marker(model_dir, dtype, seed, target_modules)
    names = ids(count)
    # A root written for more adapters serves fewer: adapter i is the same whatever the count.
    if _written(marker_path, marker) >= count and all((root / n / "adapter_config.json").exists() for n in names):
        return names
    from quiver_server.logging_setup import adopt_transformers_logging

    adopt_transformers_logging()  # transformers' warnings in our log format, not on stdout
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    models = {rank: _meta_peft_model(model_dir, rank, torch_dtype, target_modules) for rank in RANKS}
    for index, name in enumerate(names):
        model = models[rank_of(index)]
        _randomise(model, generator, torch_dtype)
        model.save_pretrained(root / name)
    marker_path.write_text(json.dumps({**marker, "count": count}, indent=1))
    return names


FLEET_RANKS = (4, 8, 16, 32, 64)


def fleet_ranks(count: int, seed: int = 0) -> list[int]:
    """Adapter i's rank in a fleet of `count`: drawn uniformly from FLEET_RANKS, seeded."""
    draw = torch.randint(len(FLEET_RANKS), (count,), generator=torch.Generator().manual_seed(seed))
    return [FLEET_RANKS[i] for i in draw.tolist()]


def fleet_ids(count: int, seed: int = 0) -> list[str]:
    return [f"f{index:04d}-r{rank}" for index, rank in enumerate(fleet_ranks(count, seed))]


def ensure_fleet(model_dir: Path, root: Path, count: int, dtype: str, seed: int = 0) -> list[str]:
    """Writes `count` distinct adapters of ranks drawn from FLEET_RANKS under `root` (once, all seven
    projections, random A and B as `_randomise` draws them) and returns their ids in index order."""
    from safetensors.torch import load_file, save_file

    model_dir = model_dir.resolve()
    marker_path = root / "bench-fleet.json"
    marker = {**_marker(model_dir, dtype, seed, TARGET_MODULES), "ranks": list(FLEET_RANKS)}
    names = fleet_ids(count, seed)
    if _written(marker_path, marker) == count and all((root / n / "adapter_model.safetensors").exists()
                                                      for n in names):
        return names
    from quiver_server.logging_setup import adopt_transformers_logging

    adopt_transformers_logging()
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    # Per rank: the directory peft wrote, and its tensors' names and shapes (B scaled, A not).
    layouts: dict[int, tuple[Path, dict[str, torch.Size]]] = {}
    for name, rank in zip(names, fleet_ranks(count, seed), strict=True):
        out = root / name
        if rank not in layouts:
            model = _meta_peft_model(model_dir, rank, torch_dtype, TARGET_MODULES)
            _randomise(model, generator, torch_dtype)
            model.save_pretrained(out)
            tensors = load_file(out / "adapter_model.safetensors")
            layouts[rank] = (out, {key: t.shape for key, t in tensors.items()})
            continue
        first, shapes = layouts[rank]
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_bytes((first / "adapter_config.json").read_bytes())
        tensors = {}
        for key, shape in shapes.items():
            weight = torch.randn(shape, generator=generator) / shape[1] ** 0.5
            if "lora_B" in key:
                weight *= SCALE
            tensors[key] = weight.to(torch_dtype)
        save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    marker_path.write_text(json.dumps({**marker, "count": count}, indent=1))
    return names


def server_flags(root: Path | None, max_active: int, max_rank: int = max(RANKS)) -> list[str]:
    """quiver's flags to serve the adapters of `root` as local adapters (none without a root)."""
    if root is None:
        return []
    return ["--adapter-source", "local", "--adapter-root", str(root),
            "--max-active-adapters", str(max_active), "--max-lora-rank", str(max_rank)]


def largest_rank(root: Path, names: list[str]) -> int:
    """The largest rank of any module of these adapters: peft's `rank_pattern` can exceed `r`
    (on fused MoE experts "all-linear" gives gate_up_proj 2r, r for each of its halves)."""
    ranks = []
    for name in names:
        config = json.loads((root / name / "adapter_config.json").read_text())
        ranks += [config["r"], *(config.get("rank_pattern") or {}).values()]
    return max(ranks)


def check_loaded(model, adapter_name: str) -> None:
    """After PeftModel.load_adapter: no LoRA weight of `adapter_name` is left as PEFT initialises
    it (lora_B zero), as one would be, silently, for keys of the file PEFT did not recognise."""
    for name, param in model.named_parameters():
        if f".{adapter_name}." in name and ("lora_A" in name or "lora_B" in name):
            if param.is_meta or not torch.any(param != 0):
                raise RuntimeError(f"adapter {adapter_name}: {name} was not loaded from its file")
