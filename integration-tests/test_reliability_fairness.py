"""Fair turns inside one queue (docs/multi-tenancy.md, "Fair turns") on the real stack: one
tenant's long streams fill the batch and queue four more behind it; another tenant's 4-token
request, sent after them, takes one of the next batch places that free up (a stream ends, or
is preempted for a queue head that waited too long), not the place behind all of them.

Nothing is timed. The check is the order of events as the clients see them: the small request
ends before at least two of the queued long streams produce their first token (one more than
the scheduler guarantees, as events reach separate clients over separate connections). Served
first come, first served, it would end after all of them had started. Every stream carries
transformers' greedy tokens, and afterwards every KV block is free and nothing runs or waits."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import openai
import pytest

import reference
from conftest import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS, SHARD_ENV
from reliability_checks import wait_idle
from served import RETURN_TOKEN_IDS, stream_token_ids
from stack import Stack, StackConfig
from tenant_keys import Key, write_keys_file

SERVED_NAME = "tiny-fair"
STARTUP_TIMEOUT_S = 300.0
BULK = Key("bulk", "sk-fair-bulk", base_model=True, tenant="bulk-jobs")
SMALL = Key("small", "sk-fair-small", base_model=True, tenant="interactive")
BATCH = 2  # --max-batch-size: two long streams fill it
LONG_STREAMS = 6  # two run, four wait
LONG_TOKENS = 600
SMALL_TOKENS = 4


@pytest.fixture(scope="module")
def fair(pool, tmp_path_factory) -> Iterator[tuple[Stack, str]]:
    model_dir = pool.model_dir("llama")
    tmp = tmp_path_factory.mktemp("fairness")
    keys_file = tmp / "keys.yaml"
    write_keys_file(keys_file, [BULK, SMALL])
    config = StackConfig(
        model_id=str(model_dir), served_model_name=SERVED_NAME, max_input_tokens=MAX_INPUT_TOKENS,
        max_total_tokens=MAX_TOTAL_TOKENS,
        # /metrics is read without a key, as a scraper on a firewalled port reads it.
        extra_env={**SHARD_ENV, "QUIVER_METRICS_OPEN": "true"},
        extra_args=["--api-keys-file", str(keys_file), "--max-batch-size", str(BATCH)],
    )
    stack = Stack(config, tmp / "fair.log").start(timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield stack, str(model_dir)
    finally:
        stack.stop()


def client(stack: Stack, key: Key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=key.key, max_retries=0, timeout=300)


async def stream(stack: Stack, key: Key, name: str, prompt: list[int], max_tokens: int,
                 events: list[str]) -> list[int]:
    """Streams one greedy completion; appends "<name> first" and "<name> done" to `events`."""
    tokens: list[int] = []
    async with client(stack, key) as sdk:
        chunks = await sdk.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, stream=True,
                                              extra_body={**RETURN_TOKEN_IDS, "ignore_eos": True})
        async for chunk in chunks:
            for choice in chunk.choices:
                new = stream_token_ids(choice)
                if new and not tokens:
                    events.append(f"{name} first")
                tokens.extend(new)
    events.append(f"{name} done")
    return tokens


async def waiting_at_least(stack: Stack, count: int) -> None:
    """Scrapes /metrics until `count` requests wait (each scrape is a round trip: the pace)."""
    while (await asyncio.to_thread(stack.metrics))["quiver_requests_waiting"] < count:
        pass


async def run_load(stack: Stack, long_prompt: list[int], small_prompt: list[int]) -> tuple[list[str], dict]:
    events: list[str] = []
    long = [asyncio.create_task(stream(stack, BULK, f"long{i}", long_prompt, LONG_TOKENS, events))
            for i in range(LONG_STREAMS)]
    await waiting_at_least(stack, LONG_STREAMS - BATCH)
    events.append("small sent")
    small = await stream(stack, SMALL, "small", small_prompt, SMALL_TOKENS, events)
    outputs = {"small": small, **{f"long{i}": tokens for i, tokens in enumerate(await asyncio.gather(*long))}}
    return events, outputs


def test_a_small_request_of_another_tenant_is_not_queued_behind_long_streams(fair) -> None:
    stack, model_dir = fair
    vocab = len(reference.load_tokenizer(model_dir))
    rng = random.Random(31)
    long_prompt = [rng.randrange(8, vocab) for _ in range(48)]
    small_prompt = [rng.randrange(8, vocab) for _ in range(6)]
    events, outputs = asyncio.run(run_load(stack, long_prompt, small_prompt))

    # The small request was sent while four long streams waited (the server's own gauge said
    # so). Served in turns it takes one of the next batch places; a long stream the scheduler
    # starts just after it ends may still reach its client first, hence one place of slack.
    done = events.index("small done")
    started_first = [e for e in events[:done] if e.startswith("long") and e.endswith(" first")]
    assert len(started_first) <= LONG_STREAMS - 2, (
        f"the small request waited for {len(started_first)} long streams to start: {events}"
    )

    reference.assert_greedy_parity(outputs["small"], reference.greedy(model_dir, small_prompt, SMALL_TOKENS,
                                                                      stop_at_eos=False), "small")
    want = reference.greedy(model_dir, long_prompt, LONG_TOKENS, stop_at_eos=False)
    for i in range(LONG_STREAMS):
        reference.assert_greedy_parity(outputs[f"long{i}"], want, f"long{i}")
    wait_idle(stack)
