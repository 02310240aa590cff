"""Is vLLM at its best in `make bench-peers`' real-model phase? Runs compiled vLLM on the demo
model in one dtype with several `--max-num-batched-tokens` values (the knob vLLM's CPU docs
name for throughput), side by side, on the real-model phase's workload (32 streams, the chat
prompts of bench/fixtures/real_prompts.py, 64 tokens), repeats alternating; prints the medians as JSON.

    .venv/bin/python -m bench.peers.vllm_sweep --dtype bfloat16 --batched-tokens 2048,8192,16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.fixtures import load, real_prompts
from bench.fixtures.paths import REPO_ROOT
from bench.peers import install as peer_install
from bench.peers import real as peers_real
from bench.peers import servers as peer_servers
from bench.suite import real_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batched-tokens", default="2048,8192,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--model-root", type=Path, default=REPO_ROOT / ".cache" / "bench-models")
    args = p.parse_args()
    from transformers import AutoTokenizer

    venv, _ = peer_install.ensure_vllm()
    demo = real_model.ensure_demo(args.model_root).resolve()
    prompts = real_prompts.prompt_ids(AutoTokenizer.from_pretrained(demo), args.concurrency * args.requests_per_client)
    real = peers_real.RealSetup(demo, prompts, [])
    limits = peers_real.limits(args, real)
    values = [int(v) for v in args.batched_tokens.split(",")]
    runs: dict[int, list[float]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory(prefix="quiver-vllm-sweep-") as logs:
        servers = {v: peer_servers.vllm(venv, demo, peers_real.BASE, Path(logs), limits, prefix_caching=False,
                                        lora_paths=None, eager=False, kv_gib=2, dtype=args.dtype,
                                        max_num_batched_tokens=v, label=f"vllm-{args.dtype}-{v}")
                   for v in values}
        try:
            for server in servers.values():
                print(f"starting {server.label}", file=sys.stderr, flush=True)
                server.start(900)
            for repeat in range(args.repeats):
                for value, server in servers.items():
                    workload = load.Workload(peers_real.BASE, prompts, args.max_tokens, args.requests_per_client)
                    figures, _ = load.measure(server.base_url + "/v1", workload, args.concurrency, 1)
                    runs[value].append(figures["throughput_tok_s"])
                    print(f"run {repeat + 1}: {server.label} {figures['throughput_tok_s']} tok/s", file=sys.stderr,
                          flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print(json.dumps({"dtype": args.dtype, "env": peer_servers.vllm_env(venv, 2),
                      "prompts": real_prompts.length_summary(prompts),
                      "max_num_batched_tokens": {str(v): {"median_tok_s": round(statistics.median(r), 2), "runs": r}
                                                 for v, r in runs.items()}}, indent=2))


if __name__ == "__main__":
    main()
