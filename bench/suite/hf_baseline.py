"""Baseline: transformers' batched `generate` on the same weights, greedy, every sequence forced
to the same length (min_new_tokens = max_new_tokens), as a static-batch server would run it."""

from __future__ import annotations

import time

import torch


def load(model_dir: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    # transformers types `to` through a wrapper that takes the device for `self`.
    return model.to(device).eval()  # type: ignore[arg-type]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model, device: str, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
            repeats: int = 3) -> dict:
    """Times `repeats` runs of one batch of `batch_size` equal-length prompts (after a short
    warm-up) and reports the fastest: the baseline gets the benefit of any noise on the machine,
    so a ratio in quiver's favour is never an artefact of a slow baseline run."""
    input_ids = torch.tensor(prompts[:batch_size], device=device)
    attention_mask = torch.ones_like(input_ids)
    args = dict(do_sample=False, pad_token_id=model.generation_config.pad_token_id)
    with torch.no_grad():
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, min_new_tokens=2, **args)
        walls = []
        for _ in range(repeats):
            sync(device)
            started = time.perf_counter()
            out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, **args)
            sync(device)
            walls.append(time.perf_counter() - started)
    generated = (out.shape[1] - input_ids.shape[1]) * batch_size
    return {
        "batch_size": batch_size,
        "generated_tokens": generated,
        "wall_s": round(min(walls), 3),
        "wall_s_all_runs": [round(w, 3) for w in walls],
        "throughput_tok_s": round(generated / min(walls), 2),
    }


@torch.no_grad()
def greedy(model, device: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One request alone, greedy, exactly `max_new_tokens` new ids (as quiver's ignore_eos)."""
    input_ids = torch.tensor([prompt], device=device)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.generation_config.pad_token_id)
    return out[0, input_ids.shape[1]:].tolist()


def best_of(runs: list[dict]) -> dict:
    """Runs of `measure` (one repeat each, e.g. alternated with quiver's) combined as `measure`
    combines its own repeats: the fastest, with every wall time listed."""
    best = min(runs, key=lambda run: run["wall_s"])
    return {**best, "wall_s_all_runs": [w for run in runs for w in run["wall_s_all_runs"]]}
