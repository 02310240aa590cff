"""`make gpu-check` phase `model`: writes the check's random model (`save_pretrained`, built on the
device so an 8B shape takes seconds to draw) and its LoRA adapters (`bench/fixtures/adapters.py`: ranks 8 and 16,
written by peft), then runs the reference: transformers greedy on the base and transformers+peft
greedy on the first adapters, on the device in the model's dtype, keeping each step's top-two
logit gap so a divergence can be judged. Leaves `reference.json` in the work directory for the
stack phase, which compares the served tokens with it (parity.json)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.fixtures import adapters, bench_model
from bench.fixtures.reference import top_two_gap
from bench.gpu_check.common import Options, log, phase_options

# Llama-3-8B's dimensions (its rope and special tokens do not matter to a random model).
SHAPES = {
    "llama3-8b": bench_model.Shape("llama3-8b-shape", 4096, 14336, 32, 32, 8, 128256, "bfloat16"),
    "tiny": bench_model.SHAPES["tiny"],
}


def check_shape(name: str) -> bench_model.Shape:
    return SHAPES[name]


def parity_prompts(options: Options) -> list[list[int]]:
    shape = check_shape(options.profile.shape)
    return [bench_model.prompts(1, length, shape.vocab_size, seed=length)[0]
            for length in options.profile.parity_prompt_tokens]


@torch.inference_mode()
def _greedy(model, prompt: list[int], new_tokens: int, device: str) -> dict:
    out = model.generate(input_ids=torch.tensor([prompt], device=device),
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return {"tokens": out.sequences[0, len(prompt):].tolist(),
            "top2_gaps": [round(top_two_gap(step[0]), 6) for step in out.logits],
            "top_logits": [round(float(step[0].float().max()), 4) for step in out.logits]}


def main() -> None:
    options = phase_options()
    profile, device = options.profile, options.device
    shape = check_shape(profile.shape)
    dtype = getattr(torch, shape.dtype)
    timings: dict[str, float] = {}

    started = time.perf_counter()
    model_dir = bench_model.ensure_model(shape, options.work / "models", device)
    timings["model_write_s"] = round(time.perf_counter() - started, 2)
    log(f"model {shape.name} ({shape.parameters() / 1e9:.2f}B parameters) in {timings['model_write_s']} s")

    started = time.perf_counter()
    adapter_root = options.work / "adapters"
    adapter_ids = adapters.ensure_adapters(model_dir, adapter_root, profile.adapters, shape.dtype)
    timings["adapters_write_s"] = round(time.perf_counter() - started, 2)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()
    timings["reference_load_s"] = round(time.perf_counter() - started, 2)

    started = time.perf_counter()
    prompts = parity_prompts(options)
    reference = {"base": [_greedy(model, p, profile.parity_new_tokens, device) for p in prompts]}
    compared = adapter_ids[: profile.parity_adapters]
    if compared:
        peft_model = PeftModel.from_pretrained(model, str(adapter_root / compared[0]), adapter_name=compared[0])
        for name in compared[1:]:
            peft_model.load_adapter(str(adapter_root / name), adapter_name=name)
        for name in compared:
            adapters.check_loaded(peft_model, name)
            peft_model.set_adapter(name)
            reference[name] = [_greedy(peft_model, p, profile.parity_new_tokens, device) for p in prompts]
    timings["reference_generate_s"] = round(time.perf_counter() - started, 2)

    options.reference_path.write_text(json.dumps({
        "model_dir": str(model_dir),
        "adapter_root": str(adapter_root),
        "adapter_ids": adapter_ids,
        "shape": shape.name,
        "parameters": shape.parameters(),
        "vocab_size": shape.vocab_size,
        "dtype": shape.dtype,
        "prompts": prompts,
        "reference": reference,
        "timings": timings,
    }))
    log(f"reference written: {Path(options.reference_path)} ({timings})")


if __name__ == "__main__":
    main()
