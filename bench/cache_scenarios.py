"""Issue 16's two workloads, for `make bench` (quiver with and without the feature) and
`make bench-peers` (every server): the same client code for all.

- shared prefix: `concurrency` streams whose prompts are one common system prefix plus a
  distinct suffix each; time to first token and throughput (prefix caching pays off here).
- long prompts arriving: `running` streams decode long outputs; once each has streamed
  `warmup_tokens`, `arrivals` requests with long prompts are sent; the running streams'
  inter-token gaps that end after that moment and before the last long request ends (its
  prefill and its decode) are reported with the long requests' time to first token (chunked
  prefill keeps those gaps even).

Every repeat draws new prompts (seeded by the repeat): a server with prefix caching would
otherwise serve a repeat's prompts from the previous repeat's cache. The shared prefix is the
same in every repeat, as a deployment's system prompt is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import bench_model
import load
from sse_client import SseConnection
from stats import percentiles


@dataclass(frozen=True)
class SharedPrefix:
    concurrency: int = 32
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    max_tokens: int = 64
    requests_per_client: int = 1

    @property
    def name(self) -> str:
        return f"shared-prefix{self.prefix_tokens}-c{self.concurrency}"

    def prompts(self, vocab_size: int, repeat: int) -> list[list[int]]:
        prefix = bench_model.prompts(1, self.prefix_tokens, vocab_size, seed=1_000)[0]
        suffixes = bench_model.prompts(self.concurrency * self.requests_per_client, self.suffix_tokens,
                                       vocab_size, seed=2_000 + repeat)
        return [prefix + suffix for suffix in suffixes]


@dataclass(frozen=True)
class LongArrivals:
    running: int = 28
    running_prompt_tokens: int = 128
    running_max_tokens: int = 256
    warmup_tokens: int = 8  # of every running stream before the long prompts are sent
    arrivals: int = 4
    arrival_prompt_tokens: int = 2048
    arrival_max_tokens: int = 16

    @property
    def name(self) -> str:
        return f"long-prompts{self.arrival_prompt_tokens}x{self.arrivals}-while-c{self.running}"

    @property
    def max_total_tokens(self) -> int:
        return max(self.arrival_prompt_tokens + self.arrival_max_tokens,
                   self.running_prompt_tokens + self.running_max_tokens)


def measure_shared_prefix(base_url: str, spec: SharedPrefix, model: str, vocab_size: int, repeat: int,
                          selection: dict | None = None) -> tuple[dict, dict[int, str]]:
    """One run (load.measure's figures and texts) on this repeat's prompts."""
    workload = load.Workload(model, spec.prompts(vocab_size, repeat), spec.max_tokens, spec.requests_per_client,
                             extra_body=selection or {})
    return load.measure(base_url, workload, spec.concurrency, 1)


@dataclass
class _Stream:
    timing: load.StreamTiming
    text: str = ""


async def _all_set(events: list[asyncio.Event]) -> None:
    for event in events:
        await event.wait()


async def _stream(conn: SseConnection, body: dict, out: _Stream, progress: asyncio.Event | None,
                  warmup_tokens: int) -> None:
    """One streamed completion into `out`; `progress` is set once it has streamed `warmup_tokens`
    (or ended, whichever is first)."""
    try:
        await _read_stream(conn, body, out, progress, warmup_tokens)
    finally:
        if progress is not None:
            progress.set()


async def _read_stream(conn: SseConnection, body: dict, out: _Stream, progress: asyncio.Event | None,
                       warmup_tokens: int) -> None:
    async for chunk in conn.post_stream("/completions", body):
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            out.timing.token_times.append(time.perf_counter())
            out.text += choices[0]["text"]
            if progress is not None and len(out.timing.token_times) == warmup_tokens:
                progress.set()
        if chunk.get("usage"):
            out.timing.completion_tokens = chunk["usage"]["completion_tokens"]
    if len(out.timing.token_times) != body["max_tokens"]:
        raise RuntimeError(f"stream ended after {len(out.timing.token_times)} of {body['max_tokens']} tokens")


def _body(model_fields: dict, prompt: list[int], max_tokens: int) -> dict:
    return {**model_fields, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def _arrivals_run(base_url: str, spec: LongArrivals, model_fields: dict, vocab_size: int,
                        repeat: int) -> dict:
    short = bench_model.prompts(spec.running, spec.running_prompt_tokens, vocab_size, seed=3_000 + repeat)
    long = bench_model.prompts(spec.arrivals, spec.arrival_prompt_tokens, vocab_size, seed=4_000 + repeat)
    conns = [SseConnection(base_url) for _ in range(spec.running + spec.arrivals)]
    try:
        # Connections and first-call paths warmed outside the measurement, as load.measure does.
        await asyncio.gather(*(_stream(c, _body(model_fields, short[0], 2), _Stream(load.StreamTiming(0.0)),
                                       None, 0) for c in conns))
        started = [asyncio.Event() for _ in range(spec.running)]
        running = [_Stream(load.StreamTiming(time.perf_counter())) for _ in range(spec.running)]
        tasks = [asyncio.create_task(_stream(conns[i], _body(model_fields, short[i], spec.running_max_tokens),
                                             running[i], started[i], spec.warmup_tokens))
                 for i in range(spec.running)]
        gate = asyncio.create_task(_all_set(started))
        while not gate.done():
            done, _ = await asyncio.wait([gate, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                error = finished.exception()
                if error is not None:
                    gate.cancel()
                    raise error
        arrived_at = time.perf_counter()
        arriving = [_Stream(load.StreamTiming(arrived_at)) for _ in range(spec.arrivals)]
        arrival_tasks = [asyncio.create_task(_stream(conns[spec.running + j],
                                                     _body(model_fields, long[j], spec.arrival_max_tokens),
                                                     arriving[j], None, 0)) for j in range(spec.arrivals)]
        await asyncio.gather(*tasks, *arrival_tasks)
    finally:
        await asyncio.gather(*(c.close() for c in conns))
    last_first_token = max(s.timing.token_times[0] for s in arriving)
    arrivals_done = max(s.timing.token_times[-1] for s in arriving)
    gaps_during, gaps_before, gaps_prefill = [], [], []
    for stream in running:
        for a, b in zip(stream.timing.token_times, stream.timing.token_times[1:], strict=False):
            if b <= arrived_at:
                gaps_before.append(b - a)
            # The window: the long prompts' prefill and their decode, until the last of them ends.
            # Later gaps (the running streams alone again) would dilute the p99 below the stalls.
            elif b <= arrivals_done:
                gaps_during.append(b - a)
                if b <= last_first_token:
                    gaps_prefill.append(b - a)
    during = percentiles(gaps_during)
    return {
        "running_streams": spec.running,
        "arrivals": spec.arrivals,
        "arrival_prompt_tokens": spec.arrival_prompt_tokens,
        "running_inter_token_s_after_arrival": during,
        "running_inter_token_s_during_prefill": percentiles(gaps_prefill),
        "running_inter_token_s_before_arrival": percentiles(gaps_before),
        "p99_over_p50": round(during["p99"] / during["p50"], 3) if during.get("count") else None,
        "arrival_ttft_s": percentiles([s.timing.ttft for s in arriving]),
        "texts": {**{i: s.text for i, s in enumerate(running)},
                  **{spec.running + j: s.text for j, s in enumerate(arriving)}},
    }


def measure_long_arrivals(base_url: str, spec: LongArrivals, model: str, vocab_size: int, repeat: int,
                          selection: dict | None = None) -> tuple[dict, dict[int, str]]:
    """One run: (figures, texts by request index: running streams first, then the arrivals)."""
    result = asyncio.run(_arrivals_run(base_url, spec, {"model": model, **(selection or {})}, vocab_size, repeat))
    return result, result.pop("texts")


def best_of_arrivals(runs: list[tuple[dict, dict[int, str]]]) -> tuple[dict, dict[int, str]]:
    """The run whose running streams kept the lowest inter-token p99 after the arrivals, with the
    p99s of all runs."""
    def p99(run: tuple[dict, dict[int, str]]) -> float:
        return run[0]["running_inter_token_s_after_arrival"].get("p99", float("inf"))

    best, texts = min(runs, key=p99)
    return {**best, "running_inter_token_p99_all_runs": [p99(r) for r in runs]}, texts
