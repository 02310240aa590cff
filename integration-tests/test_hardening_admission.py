"""Admission and bounded waits on the real stack (docs/security.md, "Request limits, admission
and waiting").

- Bodies that would make the router build millions of choices or tokenize megabytes are refused
  with 400 before that work, and the router's peak memory (VmHWM) barely moves.
- A request that could never run on an idle server is 400, never 429 (SDKs retry 429).
- `--max-concurrent-requests` counts requests, not choices.
- Two long n=8 streams that hold the whole KV cache do not starve a 4-token request: it is served
  by preempting them, and they still finish with exactly the tokens of an undisturbed run.
- With `--max-queue-wait-secs`, a request that cannot start in time gets 503 `queue_timeout`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from conftest import SHARD_ENV, Served
from served import RETURN_TOKEN_IDS, stream_token_ids, token_ids
from stack import Stack, StackConfig

# Above the 17 choices of the preemption scenario, so an older build that counted choices
# shows its head-of-line blocking there rather than a 429.
MAX_CONCURRENT_REQUESTS = 24
MAX_CHOICES = 16
# KV cache the scheduler may hand out: two of the long requests below fill it, with ~1000 tokens
# per choice, so they run for many decode steps.
MAX_BATCH_TOTAL_TOKENS = 16384
LONG_N = 8
# How far the router's peak RSS may rise while it refuses every oversized body below. Building
# the choices of the first one took the old router over 1 GB.
RSS_BUDGET_BYTES = 96 << 20
# What the router may keep resident after refusing four 4 MB bodies (it held 740 MB once).
KEPT_AFTER_LARGE_BODIES = 40 << 20
STARTUP_SECONDS = 300.0


def _start(pool, tmp_path_factory, name: str, flags: dict[str, str]) -> Iterator[Served]:
    """The admission flags go in their variables (`QUIVER_…`): a build that lacks them still
    starts, so these tests show what it does wrong rather than only refusing its flags."""
    config = StackConfig(
        model_id=str(pool.model_dir("llama")),
        served_model_name="tiny-llama",
        max_input_tokens=256,
        max_total_tokens=1024,
        max_concurrent_requests=MAX_CONCURRENT_REQUESTS,
        extra_args=["--max-batch-total-tokens", str(MAX_BATCH_TOTAL_TOKENS)],
        extra_env={**SHARD_ENV, **flags},
    )
    log = tmp_path_factory.mktemp(name) / "stack.log"
    # A longer start-up allowance than the pool's: these stacks start while others compile.
    stack = Stack(config, log).start(timeout_s=STARTUP_SECONDS)
    try:
        yield Served("llama", Path(config.model_id or ""), stack, "tiny-llama")
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def small(pool, tmp_path_factory) -> Iterator[Served]:
    """A small KV cache, few concurrent requests, a quick preemption."""
    yield from _start(pool, tmp_path_factory, "admission", {
        "QUIVER_MAX_CHOICES_PER_REQUEST": str(MAX_CHOICES), "QUIVER_PREEMPTION_WAIT_MS": "200"})


@pytest.fixture(scope="module")
def patient(pool, tmp_path_factory) -> Iterator[Served]:
    """Preemption out of reach, a one-second queue deadline."""
    yield from _start(pool, tmp_path_factory, "deadline", {
        "QUIVER_PREEMPTION_WAIT_MS": "600000", "QUIVER_MAX_QUEUE_WAIT_SECS": "1"})


def _router_memory(served: Served, field: str) -> int:
    """A memory figure of the router's /proc status in bytes: VmHWM (peak resident) or VmRSS
    (resident now); the router is the launcher's child."""
    pids = [pid for pid, cmd in served.stack.descendants() if "quiver-router" in cmd.split(" ")[0]]
    assert len(pids) == 1, served.stack.descendants()
    for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/<router>/status")


def _router_peak_rss(served: Served) -> int:
    return _router_memory(served, "VmHWM")


def _post(served: Served, body: dict) -> tuple[int, dict]:
    return served.stack.post_json("/v1/completions", body, timeout=120)


def _assert_refused(status: int, payload: dict, code: str, limit: str) -> None:
    assert status == 400, payload
    error = payload["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code), error
    assert limit in error["message"], error


def test_oversized_bodies_are_refused_before_the_work_they_ask_for(small):
    before = _router_peak_rss(small)
    # Refused before the work they ask for: no prefill runs for any of them, and no prompt
    # token is counted (the counters, not the clock, show it).
    work = ("quiver_prefill_steps_total", "quiver_prompt_tokens_total")
    work_before = [small.stack.metrics()[series] for series in work]
    # 60,000 one-token prompts × n=128 (7.7 million choices) in a 300 KB body.
    status, payload = _post(small, {"model": small.model, "prompt": [[1]] * 60_000,
                            "n": 128, "max_tokens": 1})
    _assert_refused(status, payload, "invalid_value", "at most 2048")
    status, payload = _post(small, {"model": small.model, "prompt": ["a"] * 10_000,
                            "max_tokens": 1})
    _assert_refused(status, payload, "invalid_value", "at most 2048")
    # Fewer prompts, but n × prompts over --max-choices-per-request.
    status, payload = _post(small, {"model": small.model, "prompt": [[1]] * 1000,
                            "max_tokens": 1})
    _assert_refused(status, payload, "invalid_value", "--max-choices-per-request")
    # 1.9 MB of text, four at once: refused from its length in bytes, never tokenized.
    text = "word " * 380_000
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda _: _post(small, {"model": small.model, "prompt": text, "max_tokens": 1}),
            range(4)))
    for status, payload in results:
        _assert_refused(status, payload, "context_length_exceeded", "--max-input-tokens")
    # The same through chat, where the text is a message.
    status, payload = small.stack.post_json("/v1/chat/completions", {
        "model": small.model, "messages": [{"role": "user", "content": text}], "max_tokens": 1},
        timeout=120)
    assert (status, payload["error"]["code"]) == (400, "context_length_exceeded"), payload
    # A token-id prompt over --max-input-tokens.
    status, payload = _post(small, {"model": small.model, "prompt": [1] * 3000,
                            "max_tokens": 1})
    _assert_refused(status, payload, "context_length_exceeded", "--max-input-tokens")
    # 400,000 ids: an array longer than any field takes, refused as it is parsed.
    status, payload = _post(small, {"model": small.model, "prompt": [1] * 400_000,
                            "max_tokens": 1})
    _assert_refused(status, payload, "invalid_body", "--max-input-tokens")
    # 800,000 one-token prompts in 3.8 MB, four at once: refused after 65,536 arrays, not after
    # building 800,000 of them (each would cost ~180 bytes parsed; this once took the router
    # from 23 MB to 600 MB, and four left it holding 740 MB).
    resident = _router_memory(small, "VmRSS")
    body = {"model": small.model, "prompt": [[1]] * 800_000, "n": 128, "max_tokens": 1}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _post(small, body), range(4)))
    for status, payload in results:
        _assert_refused(status, payload, "invalid_body", "65536 arrays and objects")
    grown = _router_peak_rss(small) - before
    assert grown < RSS_BUDGET_BYTES, f"router peak RSS grew by {grown >> 20} MiB"
    # What the large bodies took was given back (malloc_trim after each) before they were answered.
    kept = _router_memory(small, "VmRSS") - resident
    assert kept < KEPT_AFTER_LARGE_BODIES, f"the router kept {kept >> 20} MiB after refusing them"
    assert [small.stack.metrics()[series] for series in work] == work_before


def test_requests_that_can_never_run_are_400_not_429(small):
    # n over --max-choices-per-request: 400 naming the flag, on an idle server.
    status, payload = _post(small, {"model": small.model, "prompt": "Hi", "n": MAX_CHOICES + 1,
                                       "max_tokens": 1})
    _assert_refused(status, payload, "invalid_value", "--max-choices-per-request")
    assert payload["error"]["param"] == "n"
    # Within the choice cap, but more than half the KV cache reserved by one request.
    status, payload = _post(small, {"model": small.model, "prompt": "Hi", "n": MAX_CHOICES,
                                       "max_tokens": 900})
    _assert_refused(status, payload, "kv_share_exceeded", "--max-request-kv-share")


def test_concurrency_counts_requests_not_choices(small):
    _wait_until_idle(small)
    # More choices than --max-concurrent-requests in one request: one request, served.
    with small.client() as client:
        response = client.completions.create(model=small.model, prompt="Hi", n=MAX_CHOICES,
                                             max_tokens=2, temperature=0)
    assert len(response.choices) == MAX_CHOICES

    async def scenario() -> None:
        async with small.async_client() as client:
            # MAX_CONCURRENT_REQUESTS streams of n=2 each (twice as many choices) are in flight.
            streams = [await client.completions.create(
                model=small.model, prompt=f"stream {i}", n=2, max_tokens=200, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
                for i in range(MAX_CONCURRENT_REQUESTS)]
            for stream in streams:
                await stream.__anext__()
            # One more request is over the limit: 429, which is retryable.
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model=small.model, prompt="Hi", max_tokens=1)
            assert refused.value.code == "rate_limit_exceeded"
            for stream in streams:
                await stream.close()

    asyncio.run(scenario())


# The long requests: one greedy, one sampled with a seed (each choice gets seed + its index).
LONG_SAMPLING: tuple[dict, ...] = ({"temperature": 0}, {"temperature": 0.9, "seed": 1234})


async def _long_stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int,
                       sampling: dict) -> tuple[dict[int, list[int]], float]:
    """Reads an n=LONG_N stream to its end: (token ids per choice, when it ended)."""
    tokens: dict[int, list[int]] = {i: [] for i in range(LONG_N)}
    stream = await client.completions.create(
        model=model, prompt=prompt, n=LONG_N, max_tokens=max_tokens, stream=True, **sampling,
        extra_body={"ignore_eos": True, **RETURN_TOKEN_IDS})
    async for chunk in stream:
        for choice in chunk.choices:
            tokens[choice.index].extend(stream_token_ids(choice))
    return tokens, time.monotonic()


def _long_max_tokens(served: Served, prompt_tokens: int) -> int:
    """max_tokens that makes one n=LONG_N request reserve half the usable cache (the most one
    request may): two such requests leave no block free."""
    limits = json.loads(served.stack.get("/info")[1])["limits"]
    block_size = limits["block_size"]
    usable_blocks = limits["max_batch_total_tokens"] // block_size
    per_choice_tokens = usable_blocks // 2 // LONG_N * block_size
    return per_choice_tokens - prompt_tokens


def _prompt_tokens(served: Served, prompt: str) -> int:
    with served.client() as client:
        response = client.completions.create(model=served.model, prompt=prompt, max_tokens=1,
                                             extra_body=RETURN_TOKEN_IDS)
    assert response.usage is not None
    return response.usage.prompt_tokens


def _wait_until_idle(served: Served) -> None:
    """Polls /metrics (with a deadline) until nothing runs or waits: streams an earlier test
    closed are let go at the scheduler's next step, and until then they hold admission slots
    (a new request would get 429) and KV blocks."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = served.stack.metrics()
        if metrics["quiver_requests_running"] == 0 and metrics["quiver_requests_waiting"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError("the server never became idle")


async def _wait_until_cache_full(served: Served) -> None:
    """Polls /metrics (with a deadline) until no KV block is free."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(served.stack.metrics)
        if metrics["quiver_kv_blocks_free"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the long streams never filled the KV cache")


def test_a_short_request_is_not_starved_by_long_streams_that_fill_the_cache(small):
    _wait_until_idle(small)
    prompts = ("one long story", "another long story")
    max_tokens = _long_max_tokens(small, max(_prompt_tokens(small, p) for p in prompts))
    preemptions_before = small.stack.metrics().get("quiver_preemptions_total", 0.0)

    async def scenario():
        async with small.async_client() as client:
            longs = [asyncio.create_task(_long_stream(client, small.model, p, max_tokens, s))
                     for p, s in zip(prompts, LONG_SAMPLING, strict=True)]
            await _wait_until_cache_full(small)
            started = time.monotonic()
            short = await client.completions.create(model=small.model, prompt="Hi", max_tokens=4,
                                                    temperature=0, extra_body=RETURN_TOKEN_IDS)
            short_done = time.monotonic()
            return short, started, short_done, await asyncio.gather(*longs)

    short, started, short_done, longs = asyncio.run(scenario())
    assert len(token_ids(short)) == 4
    long_ends = [ended for _, ended in longs]
    # Served while both long streams were still generating: without preemption it would have
    # waited for one of them to finish (~max_tokens decode steps).
    assert short_done < min(long_ends), (short_done - started, [e - started for e in long_ends])
    assert small.stack.metrics().get("quiver_preemptions_total", 0.0) > preemptions_before

    # The preempted streams resumed by recomputation: each choice has exactly the tokens the
    # same request gets alone, without preemption (greedy, and seeded sampling whose generator
    # skips the draws already made).
    with small.client() as client:
        for prompt, sampling, (streamed, _) in zip(prompts, LONG_SAMPLING, longs, strict=True):
            alone = client.completions.create(
                model=small.model, prompt=prompt, n=LONG_N, max_tokens=max_tokens, **sampling,
                extra_body={"ignore_eos": True, **RETURN_TOKEN_IDS})
            for index in range(LONG_N):
                assert streamed[index] == token_ids(alone, index), (prompt, index)
                assert len(streamed[index]) == max_tokens


def test_a_request_that_cannot_start_in_time_gets_503_queue_timeout(patient):
    _wait_until_idle(patient)
    prompts = ("one long story", "another long story")
    max_tokens = _long_max_tokens(patient, max(_prompt_tokens(patient, p) for p in prompts))

    async def scenario():
        async with patient.async_client() as client:
            longs = [asyncio.create_task(_long_stream(client, patient.model, p, max_tokens, s))
                     for p, s in zip(prompts, LONG_SAMPLING, strict=True)]
            await _wait_until_cache_full(patient)
            refused = await asyncio.to_thread(
                patient.stack.post_json, "/v1/completions",
                {"model": patient.model, "prompt": "Hi", "max_tokens": 4})
            return refused, await asyncio.gather(*longs)

    (status, payload), longs = asyncio.run(scenario())
    assert status == 503, payload
    assert (payload["error"]["type"], payload["error"]["code"]) == ("server_error", "queue_timeout")
    assert "--max-queue-wait-secs" in payload["error"]["message"]
    # The running streams were not touched.
    for streamed, _ in longs:
        assert all(len(ids) == max_tokens for ids in streamed.values())
