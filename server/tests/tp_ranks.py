"""Runs the engine on tensor-parallel ranks in processes of their own (gloo, loopback), for the
tests of models/tensor_split.py: every rank serves the same steps, as the router's fan-out makes
them, and each reports what it answered and what it holds."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from quiver_server.engine.batch_types import RequestSpec, SamplingParams


@dataclass(frozen=True)
class Script:
    """The steps every rank runs: adapters to load and activate (slot = index), then one prefill
    of `prompts` (prompt, adapter id or "") and `decode_steps` decode steps."""

    model_dir: Path
    prompts: list[tuple[list[int], str]]
    decode_steps: int
    adapters: dict[str, Path] = field(default_factory=dict)
    dtype: str = "float32"
    quantize: str | None = None
    top_logprobs: int = 5


@dataclass
class RankResult:
    # per request: (token, logprob, [(token, logprob) of the top alternatives]) per step
    steps: dict[int, list[tuple[int, float, list[tuple[int, float]]]]]
    held_numel: int  # elements of the model's parameters and packed weights on this rank
    kv_heads: int
    memory_kib: dict[str, int]  # the rank process's VmHWM (peak resident) and RssAnon at the end
    checkpoint_bytes: tuple[int, int]  # (read by this rank, the whole checkpoint's)


def serve_script(script: Script, tp: Any) -> RankResult:
    from quiver_server.engine.engine import Engine

    engine = Engine(str(script.model_dir), "tp-test", dtype=script.dtype, device="cpu", quantize=script.quantize,
                    adapter_root=str(next(iter(script.adapters.values())).parent) if script.adapters else None,
                    tp=tp, cpu_kv_cache_gib=0.02)
    engine.warmup(256, 256, 8, max_active_adapters=max(1, len(script.adapters)), max_lora_rank=16)
    for slot, (adapter_id, path) in enumerate(script.adapters.items()):
        engine.lora.load(adapter_id, "local", str(path))
        engine.activate_adapter(adapter_id, slot)
    blocks_each = 8
    requests = [RequestSpec(id=i, input_ids=prompt, blocks=list(range(i * blocks_each, (i + 1) * blocks_each)),
                            sampling=SamplingParams(top_logprobs=script.top_logprobs), adapter_id=adapter,
                            max_new_tokens=script.decode_steps + 1)
                for i, (prompt, adapter) in enumerate(script.prompts)]
    steps: dict[int, list[tuple[int, float, list[tuple[int, float]]]]] = {r.id: [] for r in requests}

    def record(result: Any) -> None:
        for out in result.generations:
            steps[out.request_id].append((out.token_id, out.logprob,
                                          [(t.token_id, t.logprob) for t in out.top_logprobs]))

    record(engine.prefill(1, requests))
    for _ in range(script.decode_steps):
        record(engine.decode([1]))
    read = engine.model.checkpoint_read
    return RankResult(steps, held_numel(engine.model), engine.kv_spec.num_kv_heads, process_memory_kib(),
                      (read.read, read.total))


def process_memory_kib() -> dict[str, int]:
    """This process's peak resident memory (VmHWM: the mapped checkpoint pages it read
    included) and its anonymous resident memory now (RssAnon: what it holds), from the kernel."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon"):
            fields[key] = int(value.split()[0])
    return fields


def held_numel(model: torch.nn.Module) -> int:
    """Weights this rank holds, as elements of the logical (unpadded) tensors: each projection's
    out x in (+ bias) whatever its packed or quantized layout, the LM head's rows x hidden once
    packed, every other parameter (norms, the embedding; a tied head counted once)."""
    from quiver_server.layers.linear import Linear

    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.out_features * module.in_features + (module.bias.numel() if module.bias is not None else 0)
            continue
        for param in module.parameters(recurse=False):
            if param.data_ptr() not in seen:
                seen.add(param.data_ptr())
                total += param.numel()
    head = model.lm_head  # type: ignore[attr-defined]
    if head.weight is None:  # packed or quantized in place of its parameter
        total += head.out_features * head.in_features
    return total


def _rank_main(rank: int, size: int, port: int, script: Script, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from quiver_server.parallel import join_group

    tp = join_group(rank, size, torch.device("cpu"))
    try:
        results.put((rank, serve_script(script, tp)))
    except Exception as error:  # reported to the test, which fails with it
        results.put((rank, repr(error)))
        raise
    finally:
        if tp.size > 1:
            torch.distributed.destroy_process_group()


def run_ranks(script: Script, size: int) -> list[RankResult | str]:
    """The script on `size` ranks, one process each; each rank's result (or its error), by rank."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = [context.Process(target=_rank_main, args=(rank, size, port, script, results)) for rank in range(size)]
    for process in processes:
        process.start()
    collected = dict(results.get() for _ in range(size))
    for process in processes:
        process.join()
    return [collected[rank] for rank in range(size)]
