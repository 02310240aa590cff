"""Structured-output scenarios (issue 14): constrained and free streams in shared batches, the
stall new schemas cause while they compile, and the per-step mask cost.

    mixed_vs_free(base_url, setup)   32 streams, every other one under a JSON schema (one schema
                                     per adapter), against the same 32 streams all free
    compile_stall(base_url, setup)   16 free streams; 8 requests with never-seen schemas arrive;
                                     the free streams' inter-token p99 before and during

Requests go to streaming /v1/completions with token-id prompts, like bench/fixtures/load.py's; constrained
ones carry `response_format: {"type": "json_schema", ...}` and end when the grammar completes
(no ignore_eos), free ones run exactly max_tokens (ignore_eos). Throughput counts the tokens
usage reports, so streams that end early are not counted as full ones.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import jsonschema

from bench.fixtures import schemas
from bench.fixtures.sse_client import SseConnection
from bench.fixtures.stats import percentiles

MASK_HISTOGRAM = "quiver_grammar_mask_seconds"
# Tokens of each free stream not counted at the start of the compile-stall run (their prefill
# and the first steps, while the 16 prompts are still arriving).
STALL_SKIP_TOKENS = 4


@dataclass(frozen=True)
class Setup:
    model: str  # the served base model name
    adapters: tuple[str, ...]  # the mixed scenario's streams spread over these; () = base model
    prompts: list[list[int]]
    max_tokens: int
    requests_per_client: int
    concurrency: int  # streams of the mixed scenario (half constrained)
    stall_streams: int  # free streams of the compile-stall run
    stall_arrivals: int  # requests with new schemas arriving during it
    stall_window_tokens: int  # tokens per free stream in the "before" window
    stall_stream_tokens: int  # max_tokens of the long free streams (cancelled once measured)
    stall_prompt_tokens: int  # prompt length of the arriving requests

    @property
    def models(self) -> tuple[str, ...]:
        return self.adapters or (self.model,)

    def schema_of(self, model: str) -> dict:
        """One schema per adapter (the base model's is the first)."""
        return schemas.object_schema(self.models.index(model), self.max_tokens)

    def stream(self, index: int, constrained_half: bool) -> tuple[str, bool]:
        """(model, constrained) of stream `index`: streams go in pairs to models[pair % n], the
        first of each pair constrained, so every adapter has as many constrained streams as
        free ones."""
        model = self.models[(index // 2) % len(self.models)]
        return model, constrained_half and index % 2 == 0


@dataclass
class Stream:
    sent_at: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""

    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def _body(model: str, prompt: list[int], max_tokens: int, schema: dict | None, name: str = "bench") -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = schemas.response_format(name, schema)
    return body


async def _stream(conn: SseConnection, body: dict, on_token=None) -> Stream:
    result = Stream(sent_at=time.perf_counter())
    async for chunk in conn.post_stream("/completions", body):
        now = time.perf_counter()
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            result.token_times.append(now)
            result.text += choices[0]["text"]
            if on_token is not None:
                on_token()
        if choices and choices[0].get("finish_reason"):
            result.finish_reason = choices[0]["finish_reason"]
        if chunk.get("usage"):
            result.completion_tokens = chunk["usage"]["completion_tokens"]
    return result


def _check(result: Stream, schema: dict | None, max_tokens: int) -> None:
    """A free stream runs max_tokens; a constrained one that finished ("stop") holds JSON valid
    for its schema: a server that ignored the schema would otherwise be timed as a cheap run."""
    if schema is None:
        if result.completion_tokens != max_tokens:
            raise RuntimeError(f"a free stream ended after {result.completion_tokens} of {max_tokens} tokens")
        return
    if result.finish_reason == "stop":
        try:
            jsonschema.validate(json.loads(result.text), schema)
        except (ValueError, jsonschema.ValidationError) as err:
            raise RuntimeError(f"a constrained output is not valid for its schema: {result.text[:200]!r}: "
                               f"{str(err)[:200]}") from err
    elif result.finish_reason != "length":
        raise RuntimeError(f"a constrained stream ended with finish_reason {result.finish_reason!r}")
    elif not result.text.startswith('{"'):
        # Cut short by max_tokens: every bench schema is an object with a required property, so
        # even a cut output starts so (a server ignoring response_format sends words).
        raise RuntimeError(f"a constrained output that ran out of tokens is no JSON object: {result.text[:200]!r}")


# ---- /metrics ---------------------------------------------------------------------------------

def scrape(base_url: str) -> dict[str, float]:
    """The router's Prometheus series, `name{labels}` -> value."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _histogram_means(before: dict, after: dict) -> dict[str, dict]:
    """Mean seconds and observations of every histogram that moved between two scrapes."""
    means = {}
    for key in after:
        if not key.endswith("_sum"):
            continue
        name = key[:-4]
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        if count > 0:
            total = after[key] - before.get(key, 0.0)
            means[name] = {"mean_ms": round(total / count * 1000, 4), "count": int(count),
                           "sum_s": round(total, 6)}
    return means


def mask_cost(before: dict, after: dict, wall_s: float) -> dict:
    """The per-step mask cost over a run, from the router's histogram of the shard's grammar_ns,
    beside the run's steps: a step-time histogram if the router exports one, else the wall time
    per step (prefill and decode calls; it includes the router's and the clients' share)."""
    histograms = _histogram_means(before, after)
    steps = {kind: int(after.get(f"quiver_{kind}_steps_total", 0) - before.get(f"quiver_{kind}_steps_total", 0))
             for kind in ("prefill", "decode")}
    cost: dict = {"histogram": MASK_HISTOGRAM, "steps": steps}
    mask = histograms.get(MASK_HISTOGRAM)
    if mask is None:
        cost["error"] = f"{MASK_HISTOGRAM} did not move (not exported, or no constrained step)"
        return cost
    cost["mask_ms_per_step"] = mask["mean_ms"]
    cost["mask_observations"] = mask["count"]
    cost["mask_total_s"] = mask["sum_s"]
    step_series = [name for name in histograms if name != MASK_HISTOGRAM and ("step" in name or "forward" in name)]
    if step_series:
        name = step_series[0]
        cost["step_ms"] = {"source": name, "mean_ms": histograms[name]["mean_ms"]}
    elif sum(steps.values()):
        cost["step_ms"] = {"source": "wall time / (prefill + decode steps)",
                           "mean_ms": round(wall_s / sum(steps.values()) * 1000, 4)}
    if "step_ms" in cost and cost["step_ms"]["mean_ms"]:
        cost["mask_share_of_step"] = round(mask["mean_ms"] / cost["step_ms"]["mean_ms"], 4)
    cost["other_histograms"] = {k: v for k, v in histograms.items() if k != MASK_HISTOGRAM}
    return cost


# ---- the mixed scenario -----------------------------------------------------------------------

def _half(results: list[tuple[Stream, bool]], constrained: bool) -> dict:
    picked = [r for r, c in results if c == constrained]
    if not picked:
        return {"requests": 0}
    reasons: dict[str, int] = {}
    for r in picked:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    return {
        "requests": len(picked),
        "mean_completion_tokens": round(statistics.mean(r.completion_tokens for r in picked), 2),
        "finish_reasons": reasons,
        "inter_token_s": percentiles([g for r in picked for g in r.inter_token()]),
    }


def _steady_throughput(per_client: list[list[tuple[Stream, bool]]]) -> float | None:
    """Tokens per second while every client is busy: from the moment every stream has its first
    token to the moment the first client gets its last one. Constrained outputs are a little
    shorter than max_tokens, so their clients finish sooner and the run's tail has only free
    streams; the whole-run rate would charge that emptier tail to the grammar. (Every token of
    the JSON tokenizer is its own chunk, so chunk times are token times.)"""
    firsts = [done[0][0].token_times[0] for done in per_client if done and done[0][0].token_times]
    lasts = [done[-1][0].token_times[-1] for done in per_client if done and done[-1][0].token_times]
    if len(firsts) != len(per_client) or len(lasts) != len(per_client):
        return None
    start, end = max(firsts), min(lasts)
    if end <= start:
        return None
    count = sum(1 for done in per_client for r, _ in done for t in r.token_times if start < t <= end)
    return round(count / (end - start), 2)


async def _warm_up(conns: list[SseConnection], setup: Setup, constrained: bool) -> None:
    """One short request per model (and per schema when constrained) before timing: adapters in
    their slots, every schema compiled and cached, as in steady state."""
    bodies = [_body(m, setup.prompts[0], 4, None) for m in setup.models]
    if constrained:
        bodies += [_body(m, setup.prompts[0], 4, setup.schema_of(m)) for m in setup.models]
    for start in range(0, len(bodies), len(conns)):
        await asyncio.gather(*(_stream(conn, body) for conn, body in zip(conns, bodies[start:start + len(conns)],
                                                                          strict=False)))


async def _mixed_run(
    base_url: str, setup: Setup, constrained_half: bool, lengths: dict[tuple[int, int], int] | None = None
) -> tuple[dict, dict, dict, dict[tuple[int, int], int]]:
    """One run of the scenario's streams, every other one constrained if `constrained_half`.
    lengths: (stream, round) -> max_tokens of that free request (default setup.max_tokens); the
    length-matched reference gives each free request the length a constrained run's request had.
    Returns the run, /metrics before and after it, and the run's own lengths."""
    conns = [SseConnection(base_url + "/v1") for _ in range(setup.concurrency)]

    async def client(i: int) -> list[tuple[Stream, bool]]:
        model, constrained = setup.stream(i, constrained_half)
        schema = setup.schema_of(model) if constrained else None
        done = []
        for round_index in range(setup.requests_per_client):
            prompt = setup.prompts[(round_index * setup.concurrency + i) % len(setup.prompts)]
            max_tokens = setup.max_tokens if lengths is None else lengths[(i, round_index)]
            result = await _stream(conns[i], _body(model, prompt, max_tokens, schema))
            _check(result, schema, max_tokens)
            done.append((result, constrained))
        return done

    try:
        await _warm_up(conns, setup, constrained_half)
        before = await asyncio.to_thread(scrape, base_url)
        started = time.perf_counter()
        per_client = await asyncio.gather(*(client(i) for i in range(setup.concurrency)))
        elapsed = time.perf_counter() - started
        after = await asyncio.to_thread(scrape, base_url)
    finally:
        await asyncio.gather(*(conn.close() for conn in conns))
    results = [r for done in per_client for r in done]
    tokens = sum(r.completion_tokens for r, _ in results)
    run = {
        "concurrency": setup.concurrency,
        "requests": len(results),
        "generated_tokens": tokens,
        "wall_s": round(elapsed, 3),
        "throughput_tok_s": round(tokens / elapsed, 2),
        "steady_throughput_tok_s": _steady_throughput(per_client),
        "inter_token_s": percentiles([g for r, _ in results for g in r.inter_token()]),
    }
    if constrained_half:
        run["constrained"] = _half(results, True)
        run["free"] = _half(results, False)
    lengths = {(i, round_index): r.completion_tokens
               for i, done in enumerate(per_client) for round_index, (r, _) in enumerate(done)}
    return run, before, after, lengths


def mixed_vs_free(base_url: str, setup: Setup, repeats: int) -> dict:
    """Per repeat: the all-free run, the mixed run, and the all-free run with the mixed run's
    output lengths (each free request as long as the same stream's request was in the mixed
    run). Constrained outputs end when their grammar completes, before max_tokens and at
    scattered moments, so their clients' next prompts arrive one by one, each a prefill step
    that pauses every stream; the plain reference has its prompts arrive in lockstep. The
    matched reference has the same arrivals and lengths, so its ratio is what the constraint
    itself costs. Each side's best throughput (as for every scenario); the mask cost over all
    mixed runs together."""
    free_runs, mixed_runs, matched_runs = [], [], []
    mask_before: dict = {}
    mask_after: dict = {}
    mixed_wall = 0.0
    for _ in range(repeats):
        free_runs.append(asyncio.run(_mixed_run(base_url, setup, False))[0])
        run, before, after, lengths = asyncio.run(_mixed_run(base_url, setup, True))
        mixed_runs.append(run)
        matched_runs.append(asyncio.run(_mixed_run(base_url, setup, False, lengths))[0])
        # Sum the deltas of every mixed run (the free runs in between add no mask time).
        for key, value in after.items():
            mask_after[key] = mask_after.get(key, 0.0) + value
            mask_before[key] = mask_before.get(key, 0.0) + before.get(key, 0.0)
        mixed_wall += run["wall_s"]
    free, mixed, matched = (max(runs, key=lambda r: r["throughput_tok_s"])
                            for runs in (free_runs, mixed_runs, matched_runs))

    def steady(runs: list[dict]) -> float:
        return max((r["steady_throughput_tok_s"] or 0.0) for r in runs)

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if a and b else None

    return {
        "streams": setup.concurrency,
        "constrained_streams": (setup.concurrency + 1) // 2,
        "adapters": list(setup.adapters),
        "schemas": {m: {"properties": len(setup.schema_of(m)["properties"])} for m in setup.models},
        "mixed": {**mixed, "throughput_tok_s_all_runs": [r["throughput_tok_s"] for r in mixed_runs]},
        "all_free": {**free, "throughput_tok_s_all_runs": [r["throughput_tok_s"] for r in free_runs]},
        "all_free_matched_lengths": {**matched,
                                     "throughput_tok_s_all_runs": [r["throughput_tok_s"] for r in matched_runs]},
        "ratio": ratio(mixed["throughput_tok_s"], free["throughput_tok_s"]),
        "steady_ratio": ratio(steady(mixed_runs), steady(free_runs)),
        "ratio_matched_lengths": ratio(mixed["throughput_tok_s"], matched["throughput_tok_s"]),
        "steady_ratio_matched_lengths": ratio(steady(mixed_runs), steady(matched_runs)),
        "mask_cost": mask_cost(mask_before, mask_after, mixed_wall),
    }


# ---- compile stall ----------------------------------------------------------------------------

async def _stall_run(base_url: str, setup: Setup, nonce: str | None) -> dict:
    """One run: free streams, then `stall_arrivals` requests at once, each with a schema never
    seen (property names prefixed by `nonce` and its index) or, with nonce None, free (the
    control: what the same arrivals cost without a compile)."""
    n = setup.stall_streams
    tokens: list[list[float]] = [[] for _ in range(n)]
    ended = [False] * n
    progressed = asyncio.Event()  # set on every free token and stream end

    async def until(predicate, what: str) -> float:
        while not predicate() and not any(ended):
            progressed.clear()
            await progressed.wait()
        if not predicate():
            raise RuntimeError(f"a free stream ended before {what}; raise --stall-stream-tokens")
        return time.perf_counter()

    free_conns = [SseConnection(base_url + "/v1") for _ in range(n)]
    arrival_conns = [SseConnection(base_url + "/v1") for _ in range(setup.stall_arrivals)]

    async def free(i: int) -> None:
        body = _body(setup.model, setup.prompts[i % len(setup.prompts)], setup.stall_stream_tokens, None)
        def record() -> None:
            tokens[i].append(time.perf_counter())
            progressed.set()

        try:
            await _stream(free_conns[i], body, record)
        finally:
            ended[i] = True
            progressed.set()

    async def arrival(k: int) -> Stream:
        prompt = setup.prompts[(n + k) % len(setup.prompts)][:setup.stall_prompt_tokens]
        schema = None if nonce is None else schemas.object_schema(k, setup.max_tokens, f"{nonce}{k}_")
        result = await _stream(arrival_conns[k], _body(setup.model, prompt, setup.max_tokens, schema, f"new{k}"))
        _check(result, schema, setup.max_tokens)
        return result

    free_tasks = [asyncio.create_task(free(i)) for i in range(n)]
    arrival_tasks: list[asyncio.Task] = []
    try:
        t_start = await until(lambda: all(len(t) >= STALL_SKIP_TOKENS for t in tokens), "the window opened")
        t_send = await until(lambda: all(len(t) >= STALL_SKIP_TOKENS + setup.stall_window_tokens for t in tokens),
                             "the arrivals")
        arrival_tasks = [asyncio.create_task(arrival(k)) for k in range(setup.stall_arrivals)]
        results = await asyncio.gather(*arrival_tasks)
        # The window closes once every free stream has had a token after the arrivals' last
        # first token: the step that follows the last compile and prefill is inside it.
        t_first = max(r.token_times[0] for r in results if r.token_times)
        await until(lambda: all(t[-1] > t_first for t in tokens), "the window closed")
        t_done = max(next(x for x in t if x > t_first) for t in tokens)
    finally:
        for task in free_tasks + arrival_tasks:
            task.cancel()  # the long free streams are cut here (the router drops them)
        await asyncio.gather(*free_tasks, *arrival_tasks, return_exceptions=True)
        await asyncio.gather(*(conn.close() for conn in free_conns + arrival_conns))

    def gaps(lo: float, hi: float) -> list[float]:
        return [b - a for t in tokens for a, b in zip(t, t[1:], strict=False) if lo < b <= hi]

    before_gaps, during_gaps = gaps(t_start, t_send), gaps(t_send, t_done)
    before, during = percentiles(before_gaps), percentiles(during_gaps)
    return {
        # The during window holds fewer gaps than the before one, so its p99 sits nearer its
        # maximum: both maxima are given too.
        "before": {**before, "max": round(max(before_gaps), 6)} if before_gaps else before,
        "during": {**during, "max": round(max(during_gaps), 6)} if during_gaps else during,
        "during_s": round(t_done - t_send, 4),
        "p99_ratio": round(during["p99"] / before["p99"], 3) if before.get("p99") and during.get("p99") else None,
        "arrival_ttft_s": percentiles([r.token_times[0] - r.sent_at for r in results if r.token_times]),
        "arrival_ttft_each_s": [round(r.token_times[0] - r.sent_at, 4) for r in results if r.token_times],
        "arrival_completion_tokens": [r.completion_tokens for r in results],
    }


async def _warm_up_grammar(base_url: str, setup: Setup) -> None:
    """One constrained request first: the shard builds its grammar tokenizer once, on the first
    grammar it sees, and that one-time cost is not what the stall measures."""
    conn = SseConnection(base_url + "/v1")
    try:
        await _stream(conn, _body(setup.model, setup.prompts[0], 4, schemas.object_schema(0, setup.max_tokens)))
    finally:
        await conn.close()


def compile_stall(base_url: str, setup: Setup, repeats: int, nonce: str) -> dict:
    """Per repeat a run with new schemas and a control run with free arrivals; the summary is the
    median over repeats of the p99 ratio."""
    asyncio.run(_warm_up_grammar(base_url, setup))
    runs, controls = [], []
    for repeat in range(repeats):
        runs.append(asyncio.run(_stall_run(base_url, setup, f"{nonce}r{repeat}x")))
        controls.append(asyncio.run(_stall_run(base_url, setup, None)))
    ratios = [r["p99_ratio"] for r in runs if r["p99_ratio"] is not None]
    control_ratios = [r["p99_ratio"] for r in controls if r["p99_ratio"] is not None]
    ratio = round(statistics.median(ratios), 3) if ratios else None
    # The same arrivals without a schema still add a prefill step to the window: during-p99 over
    # the control's during-p99 is what the compiles themselves add.
    vs_control = [r["during"]["p99"] / c["during"]["p99"] for r, c in zip(runs, controls, strict=True)
                  if r["during"].get("p99") and c["during"].get("p99")]
    return {
        "free_streams": setup.stall_streams,
        "new_schema_arrivals": setup.stall_arrivals,
        "window_tokens": setup.stall_window_tokens,
        "p99_ratio": ratio,
        "arrival_prompt_tokens": setup.stall_prompt_tokens,
        "p99_ratio_control_free_arrivals": round(statistics.median(control_ratios), 3) if control_ratios else None,
        "during_p99_vs_control": round(statistics.median(vs_control), 3) if vs_control else None,
        "runs": runs,
        "control_free_arrivals": controls,
    }
