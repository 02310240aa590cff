"""`make bench`'s embeddings block (issue 30): `/v1/embeddings` on the bench model, alone and
while chat streams decode, and what the embeddings cost those streams.

On one stack, three runs per repeat, repeats alternating:
  - `embeddings_alone`: `clients` closed-loop clients, each sending `requests` requests of
    `batch` token-id inputs of `input_tokens` tokens;
  - `chat_alone`: `streams` streaming completions (bench/fixtures/load.py's closed loop), their inter-token gaps;
  - `both`: the same chat streams with the same embedding clients beside them, the embedding
    clients looping until the chat streams are done.
Reported: inputs and tokens embedded per second alone and beside chat (and their ratio), the chat
streams' throughput and inter-token p50/p99 alone and beside embeddings (and the p99's ratio),
each as the median of the repeats with every repeat's figure listed.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.fixtures import bench_model, load
from bench.fixtures.sse_client import SseConnection
from bench.fixtures.stack import Stack, StackConfig

SERVED = "embed-bench"


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def _embed_loop(conn: SseConnection, inputs: list[list[int]], requests: int | None,
                      until: asyncio.Event | None) -> tuple[int, int]:
    """Sends embedding requests one after another: `requests` of them, or until `until` is set.
    Returns (inputs embedded, tokens embedded)."""
    done_inputs = done_tokens = sent = 0
    while (requests is None or sent < requests) and not (until is not None and until.is_set()):
        answer = await conn.post_json("/embeddings", {"model": SERVED, "input": inputs, "encoding_format": "base64"})
        if len(answer["data"]) != len(inputs):
            raise RuntimeError(f"{len(answer['data'])} embeddings for {len(inputs)} inputs")
        done_inputs += len(inputs)
        done_tokens += answer["usage"]["prompt_tokens"]
        sent += 1
    return done_inputs, done_tokens


async def _embeddings(base_url: str, batches: list[list[list[int]]], requests: int | None,
                      until: asyncio.Event | None = None) -> dict[str, float]:
    conns = [SseConnection(base_url) for _ in batches]
    try:
        started = time.perf_counter()
        counts = await asyncio.gather(*(_embed_loop(conn, inputs, requests, until)
                                        for conn, inputs in zip(conns, batches, strict=True)))
        elapsed = time.perf_counter() - started
    finally:
        await asyncio.gather(*(conn.close() for conn in conns))
    inputs, tokens = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {"inputs": inputs, "wall_s": round(elapsed, 3), "inputs_per_s": round(inputs / elapsed, 2),
            "tokens_per_s": round(tokens / elapsed, 1)}


async def _both(base_url: str, workload: load.Workload, streams: int, batches: list[list[list[int]]]) -> tuple:
    chat_done = asyncio.Event()

    async def chat() -> dict:
        try:
            return (await load.run_once(base_url, workload, streams))[0]
        finally:
            chat_done.set()

    return await asyncio.gather(chat(), _embeddings(base_url, batches, None, chat_done))


def _chat_row(run: dict) -> dict[str, float]:
    gaps = run["inter_token_s"]
    return {"throughput_tok_s": run["throughput_tok_s"], "inter_token_p50_ms": round(gaps["p50"] * 1e3, 2),
            "inter_token_p99_ms": round(gaps["p99"] * 1e3, 2)}


def _median_rows(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Each figure's median over the repeats, with every repeat's value."""
    keys = [k for k in rows[0] if k not in ("inputs", "wall_s")]
    return {**{k: round(statistics.median(r[k] for r in rows), 2) for k in keys},
            "runs": [{k: r[k] for k in keys} for r in rows]}


def run(model_root: Path, device: str, shape: bench_model.Shape, repeats: int, clients: int, batch: int,
        input_tokens: int, requests: int, streams: int, max_tokens: int, requests_per_client: int,
        logs: Path) -> dict:
    model_dir = bench_model.ensure_model(shape, model_root, device)
    inputs = bench_model.prompts(clients * batch, input_tokens, shape.vocab_size, seed=5)
    batches = [inputs[i * batch:(i + 1) * batch] for i in range(clients)]
    chat_prompts = bench_model.prompts(streams, 128, shape.vocab_size, seed=6)
    workload = load.Workload(SERVED, chat_prompts, max_tokens, requests_per_client)
    config = StackConfig(model_id=str(model_dir), served_model_name=SERVED, dtype=shape.dtype, device=device,
                         cpu_kv_cache_gib=1.0, max_total_tokens=max(input_tokens, 128 + max_tokens) + 16,
                         max_batch_size=streams, extra_args=["--prefix-caching", "false"])
    runs: dict[str, list] = {"embeddings_alone": [], "chat_alone": [], "embeddings_beside_chat": [],
                             "chat_beside_embeddings": []}
    with Stack(config, logs / "quiver-embeddings.log") as stack:
        base_url = stack.base_url + "/v1"
        asyncio.run(_embeddings(base_url, batches[:1], 1))  # first-call paths, outside the measurement
        for repeat in range(repeats):
            log(f"embeddings, run {repeat + 1}/{repeats}: {clients} clients of {batch} inputs alone")
            runs["embeddings_alone"].append(asyncio.run(_embeddings(base_url, batches, requests)))
            log(f"embeddings, run {repeat + 1}/{repeats}: {streams} chat streams alone")
            runs["chat_alone"].append(_chat_row(asyncio.run(load.run_once(base_url, workload, streams))[0]))
            log(f"embeddings, run {repeat + 1}/{repeats}: both at once")
            chat, embedded = asyncio.run(_both(base_url, workload, streams, batches))
            runs["chat_beside_embeddings"].append(_chat_row(chat))
            runs["embeddings_beside_chat"].append(embedded)
    block: dict[str, Any] = {
        "model": f"bench model ({shape.dtype})", "clients": clients, "inputs_per_request": batch,
        "input_tokens": input_tokens, "requests_per_client_alone": requests, "chat_streams": streams,
        "chat_max_tokens": max_tokens, "repeats": repeats,
        **{name: _median_rows(rows) for name, rows in runs.items()},
    }
    block["embeddings_beside_chat_over_alone"] = round(
        block["embeddings_beside_chat"]["inputs_per_s"] / block["embeddings_alone"]["inputs_per_s"], 3)
    block["chat_inter_token_p99_beside_over_alone"] = round(
        block["chat_beside_embeddings"]["inter_token_p99_ms"] / block["chat_alone"]["inter_token_p99_ms"], 3)
    block["chat_throughput_beside_over_alone"] = round(
        block["chat_beside_embeddings"]["throughput_tok_s"] / block["chat_alone"]["throughput_tok_s"], 3)
    return block
