"""Every family served by the engine in a 16-bit dtype on one device, against transformers in
the same dtype on the same device: greedy continuations of a few prompts, how many leading
tokens agree, and at the first disagreement how close the reference's two best logits were (a
near-tie there is rounding, not a bug). JSON on stdout.

    PYTHONPATH=server:server/tests python -m bench.gpu_check.family_greedy --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from block_tables import Blocks
from tiny_models import build_tiny_model

from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.engine import Engine

NEW_TOKENS = 16
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 2048, "pad_token_id": 0}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 128, "norm_topk_prob": True}),
    "mixtral": ("mixtral", {"num_local_experts": 8}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32, "sliding_window": 8}),
    "gemma3": ("gemma3_text", {"query_pre_attn_scalar": 32, "sliding_window": 8,
                               "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}),
    "phi3": ("phi3", {}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
                            "logits_scaling": 2.0}),
}


def _engine_greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    blocks = Blocks()
    requests = [RequestSpec(id=i, input_ids=p, blocks=blocks.table(len(p) + NEW_TOKENS), max_new_tokens=NEW_TOKENS)
                for i, p in enumerate(prompts)]
    outputs: dict[int, list[int]] = {}
    steps = [engine.prefill(1, requests)] + [engine.decode([1]) for _ in range(NEW_TOKENS - 1)]
    for step in steps:
        for generation in step.generations:
            outputs.setdefault(generation.request_id, []).append(generation.token_id)
    engine.clear_cache(1)
    return [outputs[i] for i in range(len(prompts))]


@torch.inference_mode()
def _reference(
    model: transformers.PreTrainedModel, prompt: list[int], device: torch.device
) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the gap between the two best logits."""
    out = model.generate(  # type: ignore[operator]
        input_ids=torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    gaps = [float((lambda top: top[0] - top[1])(logits[0].float().topk(2).values)) for logits in out.logits]
    return out.sequences[0, len(prompt):].tolist(), gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2048) for _ in range(n)] for n in (7, 33, 90, 250)]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "new_tokens": NEW_TOKENS, "families": {}}
    for name, (arch, overrides) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            config: dict[str, Any] = {**SHAPE, **overrides}
            path = build_tiny_model(Path(tmp), arch, seed=5, **config)
            reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                                          attn_implementation="eager")
            reference = reference.to(device).eval()  # type: ignore[arg-type]
            engine = Engine(str(path), name, dtype=args.dtype, device=str(device), gpu_memory_fraction=0.2)
            engine.warmup(1024, 512, 8)
            start = time.perf_counter()
            ours = _engine_greedy(engine, prompts)
            elapsed = time.perf_counter() - start
            rows = []
            for prompt, got in zip(prompts, ours, strict=True):
                expected, gaps = _reference(reference, prompt, device)
                agree = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), NEW_TOKENS)
                gap = None if agree == NEW_TOKENS else round(gaps[agree], 4)
                rows.append({"prompt_tokens": len(prompt), "agreeing_prefix": agree,
                             "reference_top2_gap_at_divergence": gap})
            report["families"][name] = {"prompts": rows, "engine_seconds": round(elapsed, 3)}
            engine.kv_cache = None
            del engine, reference
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps({name: report["families"][name]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
