"""Random LoRA adapters written by `peft` itself, and `peft` as the reference that runs them.

    from tiny_adapters import build_adapter, peft_reference, reference_greedy
    adapter = build_adapter(base_dir, tmp_path / "a", seed=1, r=8, target_modules=["q_proj", "v_proj"])
    model = peft_reference(base_dir, adapter)        # transformers base + PeftModel, float32, eval

PEFT initialises lora_B to zero (an untrained adapter changes nothing), so both halves are
redrawn here at a scale that moves the logits well away from the base model's: a wrong
scaling, a missed module or a swapped slot then changes greedy tokens, not just the 5th decimal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peft
import safetensors.torch
import torch
import transformers

from quiver_server.logging_setup import adopt_transformers_logging

# Tie rule of DESIGN.md: a greedy divergence is accepted only where the reference's two best
# logits are this close.
TIE_TOLERANCE = 1e-4


def build_adapter(
    base_dir: Path,
    adapter_dir: Path,
    seed: int,
    scale: float = 0.3,
    safe_serialization: bool = True,
    **lora_config: Any,
) -> Path:
    """Writes a random LoRA adapter for the model in `base_dir` with peft's save_pretrained.
    `lora_config` goes to peft.LoraConfig (r, lora_alpha, target_modules, use_rslora, ...)."""
    adopt_transformers_logging()
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:  # [r, in]: unit-variance rank components
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                param.copy_(scale * torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_magnitude_vector" in name:  # DoRA (only built to be refused)
                param.copy_(param + 0.1 * torch.randn(param.shape, generator=generator))
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(adapter_dir, safe_serialization=safe_serialization)
    return adapter_dir


# transformers 4's per-expert Linear names, as adapters trained then name them: family ->
# (the sparse MLP module, gate, up, down).
LEGACY_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def build_legacy_expert_adapter(base_dir: Path, adapter_dir: Path, seed: int, r: int, lora_alpha: float,
                                scale: float = 0.3) -> Path:
    """A random adapter on every expert of a sparse model as PEFT wrote them on transformers 4,
    one Linear per expert (layers.L.block_sparse_moe.experts.E.w1). Written by hand: current
    transformers has no per-expert Linears to wrap; current peft still reads such adapters,
    converting them to its fused-expert form, so it stays the reference that runs them."""
    config = json.loads((base_dir / "config.json").read_text())
    parent, *names = LEGACY_EXPERT_NAMES[config["model_type"]]
    hidden = config["hidden_size"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    experts = config.get("num_local_experts") or config["num_experts"]
    shapes = dict(zip(names, [(hidden, width), (hidden, width), (width, hidden)], strict=True))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for expert in range(experts):
            for name, (inputs, outputs) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{parent}.experts.{expert}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, inputs, generator=generator) / inputs ** 0.5
                tensors[f"{key}.lora_B.weight"] = scale * torch.randn(outputs, r, generator=generator) / r ** 0.5
    adapter_dir.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(adapter_dir / "adapter_model.safetensors"))
    lora_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha,
                   "target_modules": names, "base_model_name_or_path": str(base_dir)}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(lora_config))
    return adapter_dir


def peft_reference(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """The base model from disk with the adapter from disk (None: the bare base), float32.
    Eager attention: some transformers releases' SDPA path drops Gemma 2's soft-capping."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                             attn_implementation="eager")
    if adapter_dir is None:
        return base.eval()
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


@dataclass
class Reference:
    """Greedy continuation of one prompt, with the logits behind each choice."""

    tokens: list[int]
    logits: list[torch.Tensor]


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Reference:
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # never stop early, never suppress EOS: plain argmax every step
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return Reference(out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits])


@torch.no_grad()
def full_forward_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Reference:
    """Greedy continuation by a full forward pass over the whole sequence at every step (no KV
    cache on the reference side, so a sliding window is transformers' mask itself)."""
    sequence, tokens, logits = list(prompt), [], []
    for _ in range(new_tokens):
        last = model(torch.tensor([sequence])).logits[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        sequence.append(tokens[-1])
    return Reference(tokens, logits)


@dataclass
class References:
    """transformers' and peft's side of a test on one tiny model and its adapters, each computed
    once: the model with adapter `kind` (None: the base) and its full-forward greedy run of a
    named prompt."""

    base_dir: Path
    adapters: dict[str, Path]
    prompts: dict[str, list[int]]
    new_tokens: int
    _models: dict[str | None, torch.nn.Module] = field(default_factory=dict, init=False)
    _runs: dict[tuple[str | None, str], Reference] = field(default_factory=dict, init=False)

    def model(self, kind: str | None) -> torch.nn.Module:
        if kind not in self._models:
            self._models[kind] = peft_reference(self.base_dir, None if kind is None else self.adapters[kind])
        return self._models[kind]

    def reference(self, kind: str | None, prompt: str) -> Reference:
        if (kind, prompt) not in self._runs:
            self._runs[(kind, prompt)] = full_forward_greedy(self.model(kind), self.prompts[prompt], self.new_tokens)
        return self._runs[(kind, prompt)]


def assert_greedy_matches(got: list[int], ref: Reference, what: str) -> None:
    """Token-for-token equality, except after a position where the reference itself is a tie."""
    assert len(got) == len(ref.tokens), what
    for position, (token, want, logits) in enumerate(zip(got, ref.tokens, ref.logits, strict=True)):
        if token != want:
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) < TIE_TOLERANCE, f"{what}: diverged at {position}: {got} vs {ref.tokens}"
            return


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The adapter kinds every parity test covers: kind -> peft.LoraConfig arguments.
ADAPTER_KINDS: dict[str, dict[str, Any]] = {
    "rank4": {"r": 4, "lora_alpha": 8, "target_modules": ALL_PROJECTIONS},
    "rank8-attention": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "rank16": {"r": 16, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
    "rank64": {"r": 64, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS},
    "qv-only": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "every-linear": {"r": 8, "lora_alpha": 8, "target_modules": "all-linear"},
    "mlp-only": {"r": 8, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "rslora": {"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL_PROJECTIONS},
    # PEFT's own matching rules: a regex over module paths, and a layer filter.
    "regex-layer0": {"r": 8, "lora_alpha": 16, "target_modules": r".*\.layers\.0\.self_attn\.(q|k|o)_proj"},
    "layers-to-transform": {
        "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "down_proj"], "layers_to_transform": [1]
    },
}
