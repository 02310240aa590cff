"""Churn (issue 12): concurrent streams over more adapters than device slots, a fifth of the
clients walking away mid-stream. Every stream that finishes carries peft's greedy tokens; once the
churn is over every KV block is free, nothing runs or waits, no adapter slot stays pinned, and the
adapters and the base still give peft's and transformers' tokens.

The server runs with prefix caching on (its default), and a third of the clients share one long
prompt per model, so blocks are shared by requests that run together, leave, and are reused
from the cache: "every block free" then counts the unreferenced cached blocks as free, as the
allocator does, and a block leaked by a reference count would show."""

from __future__ import annotations

import asyncio

import openai
import pytest

import reference
from adapter_models import (
    CHAT,
    COMPLETION_PROMPTS,
    MAX_TOKENS,
    SERVED_NAME,
    PeakRunning,
    adapter_set,
    chat_ids,
    completion_ids,
    peft_greedy,
    start_stack,
)
from reliability_checks import wait_idle
from reliability_soak import TALLY, scaled
from served import RETURN_TOKEN_IDS, stream_token_ids, token_ids

SLOTS = 2
ADAPTERS = ["kinds/rank4", "kinds/rank8", "kinds/qv-only", "kinds/rslora"]
MODELS: list[str | None] = [None, *ADAPTERS]  # None: the base model
STREAMS = 24
# Clients 0, 5, 10, ... leave after a couple of chunks: 5 of 24, about a fifth.
LEAVE_EVERY = 5
CHUNKS_BEFORE_LEAVING = 2
# A leaving client asks for far more than it reads, so it certainly leaves mid-stream.
LEAVER_MAX_TOKENS = 400
ROUNDS = scaled(1)
# The slot check's requests: long enough that two of them certainly overlap in the batch.
OVERLAP_TOKENS = 64
# A prompt of several KV blocks (about 70 tokens; a leaver asks 400 more of the 512 allowed),
# shared by a third of the clients (of each model).
SHARED_PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests. " * 2
# Guards against a hang (a deadlock would stop here), not timing assertions.
ROUND_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "reliability-churn", max_active_adapters=SLOTS)
    yield stack
    stack.stop()


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _model(i: int) -> str | None:
    """Client i's model: each in turn, shifted every round of them, so that the leavers (every
    LEAVE_EVERY-th client) are spread over the base and every adapter too."""
    return MODELS[(i + i // len(MODELS)) % len(MODELS)]


def _prompt(i: int) -> str | list[dict]:
    """Client i's prompt: a chat every third client, the shared long prompt every third, else the
    completion prompts in turn."""
    if i % 3 == 2:
        return CHAT
    return SHARED_PROMPT if i % 3 == 1 else COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)]


def _prompt_ids(adapters, prompt) -> list[int]:
    return completion_ids(adapters, prompt) if isinstance(prompt, str) else chat_ids(adapters, prompt)


async def _stream(client, model: str | None, prompt, max_tokens: int, leave_after: int | None,
                  extra: dict) -> tuple[list[int], str | None]:
    """Streams one request; the token ids and finish reason it got, or stops reading and closes
    the connection after `leave_after` chunks."""
    common = dict(model=model or SERVED_NAME, max_tokens=max_tokens, temperature=0, stream=True,
                  extra_body={**RETURN_TOKEN_IDS, **extra})
    if isinstance(prompt, str):
        stream = await client.completions.create(prompt=prompt, **common)
    else:
        stream = await client.chat.completions.create(messages=prompt, **common)
    got: list[int] = []
    reason: str | None = None
    chunks = 0
    async for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            got += stream_token_ids(choice)
            reason = choice.finish_reason or reason
        if leave_after is not None and chunks >= leave_after:
            await stream.close()
            TALLY.record("client_left_mid_stream")
            return got, None
    TALLY.record(200)
    return got, reason


async def _churn(stack) -> list[tuple[list[int], str | None]]:
    async with _client(stack) as client:
        return await asyncio.gather(*(
            _stream(client, _model(i), _prompt(i), LEAVER_MAX_TOKENS, CHUNKS_BEFORE_LEAVING,
                    {"ignore_eos": True})
            if i % LEAVE_EVERY == 0 else
            _stream(client, _model(i), _prompt(i), MAX_TOKENS, None, {})
            for i in range(STREAMS)
        ))


def _run(stack, coroutine):
    try:
        return asyncio.run(asyncio.wait_for(coroutine, ROUND_TIMEOUT_S))
    except TimeoutError:
        pytest.fail(f"not finished in {ROUND_TIMEOUT_S}s (deadlock?)\n--- stack log tail ---\n{stack.log()[-4000:]}")


def _assert_slots_all_usable(adapters, stack, pair: tuple[str, str]) -> None:
    """Two adapters at once must run side by side in the two slots. A slot still pinned by an
    adapter outside the pair (a leaked reference from the churn) would leave one slot for
    both, and they would run one after the other; their tokens must equal peft's either way."""

    async def both():
        async with _client(stack) as client:
            return await asyncio.gather(*(
                _stream(client, model, COMPLETION_PROMPTS[0], OVERLAP_TOKENS, None, {"ignore_eos": True})
                for model in pair
            ))

    with PeakRunning(stack) as running:
        results = _run(stack, both())
    prompt_ids = completion_ids(adapters, COMPLETION_PROMPTS[0])
    for model, (got, reason) in zip(pair, results, strict=True):
        assert reason == "length", (model, reason)
        want = peft_greedy(adapters, model, prompt_ids, OVERLAP_TOKENS, stop_at_eos=False)
        reference.assert_greedy_parity(got, want, f"{model} after the churn")
    assert running.value >= 2, f"{pair} never ran side by side: an adapter slot is still pinned"


def test_churn_returns_every_block_and_slot_and_keeps_outputs_exact(adapters, stack):
    hits_before = wait_idle(stack)["quiver_prefix_cache_hits_total"]
    for round_ in range(ROUNDS):
        with PeakRunning(stack) as running:
            results = _run(stack, _churn(stack))
        for i, (got, reason) in enumerate(results):
            if i % LEAVE_EVERY == 0:
                continue
            model, prompt = _model(i), _prompt(i)
            context = f"round {round_} client {i} ({model or 'base'}, {prompt!r})"
            assert reason in ("stop", "length"), f"{context}: finish_reason {reason}"
            reference.assert_greedy_parity(got, peft_greedy(adapters, model, _prompt_ids(adapters, prompt)), context)
        assert running.value >= 2, f"at most {running.value} requests ran at once: no churn happened"

        # Every block back, nothing running or waiting, however the clients left.
        metrics = wait_idle(stack)
        assert metrics["quiver_adapter_slots"] == SLOTS
        assert metrics["quiver_adapters_active"] <= SLOTS
        assert metrics["quiver_prefix_cache_hits_total"] > hits_before, "the shared prompt was never a cache hit"
        hits_before = metrics["quiver_prefix_cache_hits_total"]

    # Any slot pinned by one adapter would be outside one of these two pairs.
    _assert_slots_all_usable(adapters, stack, (ADAPTERS[0], ADAPTERS[1]))
    _assert_slots_all_usable(adapters, stack, (ADAPTERS[2], ADAPTERS[3]))

    # And plain requests, one per model, still equal the reference.
    async def each_model():
        async with _client(stack) as client:
            return [await client.completions.create(model=model or SERVED_NAME, prompt=COMPLETION_PROMPTS[1],
                                                    max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS)
                    for model in MODELS]

    prompt_ids = completion_ids(adapters, COMPLETION_PROMPTS[1])
    for model, response in zip(MODELS, _run(stack, each_model()), strict=True):
        reference.assert_greedy_parity(token_ids(response), peft_greedy(adapters, model, prompt_ids),
                                       f"{model or 'base'} after the churn")
    wait_idle(stack)
