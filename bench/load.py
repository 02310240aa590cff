"""Load generator: concurrent streaming clients (lean raw-HTTP SSE, see sse_client.py), timing
every token.

Each of `concurrency` clients sends its requests one after another (a closed loop, like a chat
frontend with that many users), so the server always has about `concurrency` streams running.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from sse_client import SseConnection
from stats import percentiles


@dataclass
class StreamTiming:
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at

    def inter_token(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass(frozen=True)
class Workload:
    model: str
    prompts: list[list[int]]  # token ids; one per request, cycled
    max_tokens: int
    requests_per_client: int
    adapters: tuple[str, ...] = ()  # requests spread over these `model` names (adapter ids)
    logprobs: int = 0  # completions' `logprobs` (alternatives per token); 0: not asked
    # Fields every request carries beyond the OpenAI ones (a peer's cache switch, see peers.py).
    extra_body: dict = field(default_factory=dict)
    # Fields per model name replacing `model` in the body: how a server without per-request
    # adapter names (llama-server) is told which adapter a request uses.
    model_bodies: dict[str, dict] = field(default_factory=dict)

    def body(self, model: str) -> dict:
        """The request's selection of model or adapter, and the extra fields."""
        return {**(self.model_bodies.get(model) or {"model": model}), **self.extra_body}

    @property
    def models(self) -> tuple[str, ...]:
        return self.adapters or (self.model,)

    def request(self, index: int) -> tuple[str, list[int]]:
        """(model, prompt) of request `index`: request i goes to models[i % len(models)], so with
        n adapters and a multiple of n streams each stream keeps one adapter."""
        return self.models[index % len(self.models)], self.prompts[index % len(self.prompts)]

    def first_requests(self, concurrency: int, limit: int) -> list[tuple[str, list[int]]]:
        """The requests a run sends, in index order, at most `limit` (0: all)."""
        total = concurrency * self.requests_per_client
        return [self.request(i) for i in range(min(total, limit) if limit else total)]


async def _stream_once(conn: SseConnection, model: str, prompt: list[int],
                       max_tokens: int, logprobs: int = 0, selection: dict | None = None) -> StreamTiming:
    """One streamed completion; `selection` replaces {"model": model} in the body (Workload.body)."""
    timing = StreamTiming(sent_at=time.perf_counter())
    body = {**(selection or {"model": model}), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    reported = 0  # tokens whose logprobs came back
    async for chunk in conn.post_stream("/completions", body):
        now = time.perf_counter()
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            timing.token_times.append(now)
            timing.text += choices[0]["text"]
        if choices and logprobs:
            reported += _logprob_entries(choices[0], logprobs)
        if chunk.get("usage"):
            timing.completion_tokens = chunk["usage"]["completion_tokens"]
    if timing.completion_tokens != max_tokens:
        raise RuntimeError(f"stream ended after {timing.completion_tokens} of {max_tokens} tokens")
    if logprobs and reported != max_tokens:
        raise RuntimeError(f"logprobs came back for {reported} of {max_tokens} tokens")
    return timing


def _logprob_entries(choice: dict, alternatives: int) -> int:
    """Tokens a streamed choice reports logprobs for; each must carry its alternatives, so a
    server that drops them fails the scenario instead of timing a cheaper run."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return 0
    tops = logprobs["top_logprobs"]
    # At least one alternative each: completions key them by text, and two tokens may decode to
    # the same text (partial UTF-8), so fewer than `alternatives` keys is legitimate.
    if any(not top for top in tops):
        raise RuntimeError(f"a token came back without its top {alternatives} logprobs")
    return len(logprobs["token_logprobs"])


async def _client_loop(conn: SseConnection, workload: Workload, client_index: int,
                       concurrency: int) -> list[tuple[int, StreamTiming]]:
    timings = []
    for round_index in range(workload.requests_per_client):
        index = round_index * concurrency + client_index
        model, prompt = workload.request(index)
        timings.append((index, await _stream_once(conn, model, prompt, workload.max_tokens, workload.logprobs,
                                                  workload.body(model))))
    return timings


async def _run(base_url: str, workload: Workload, concurrency: int) -> tuple[dict, dict[int, str]]:
    conns = [SseConnection(base_url) for _ in range(max(concurrency, len(workload.models)))]
    try:
        # One short request per model first, outside the measurement: connection set-up,
        # first-call paths, and each adapter loaded and in a device slot (steady state is what
        # is measured; the first request of an adapter also pays for reading it from disk).
        await asyncio.gather(*(_stream_once(conn, model, workload.prompts[0], 4, 0, workload.body(model))
                               for conn, model in zip(conns, workload.models, strict=False)))
        cpu_started, started = time.process_time(), time.perf_counter()
        per_client = await asyncio.gather(
            *(_client_loop(conns[i], workload, i, concurrency) for i in range(concurrency))
        )
        elapsed, client_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        await asyncio.gather(*(conn.close() for conn in conns))
    indexed = [t for client_timings in per_client for t in client_timings]
    timings = [t for _, t in indexed]
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "generated_tokens": tokens,
        "wall_s": round(elapsed, 3),
        "throughput_tok_s": round(tokens / elapsed, 2),
        "ttft_s": percentiles([t.ttft for t in timings]),
        "inter_token_s": percentiles([gap for t in timings for gap in t.inter_token()]),
        # The load generator shares the machine with the server: its own CPU time is reported
        # so its cost can be seen next to the throughput.
        "load_generator_cpu_s": round(client_cpu, 3),
    }, {index: t.text for index, t in indexed}


def measure(base_url: str, workload: Workload, concurrency: int, repeats: int = 1) -> tuple[dict, dict[int, str]]:
    """`repeats` runs, combined by `best_of`."""
    return best_of([asyncio.run(_run(base_url, workload, concurrency)) for _ in range(repeats)])


def best_of(runs: list[tuple[dict, dict[int, str]]]) -> tuple[dict, dict[int, str]]:
    """The best run by throughput, as for the baselines: the machine's noise (other processes on
    a shared box) is kept out of the comparison on both sides. Also returns that run's generated
    text per request index (for the agreement check against peft)."""
    best, texts = max(runs, key=lambda run: run[0]["throughput_tok_s"])
    return {**best, "throughput_tok_s_all_runs": [run[0]["throughput_tok_s"] for run in runs]}, texts
