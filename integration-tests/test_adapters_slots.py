"""Six adapters through two device slots (`--max-active-adapters 2`): requested in rotation, one
at a time and all at once over several rounds, every output still equals peft's and nothing
deadlocks (every phase runs under a time limit). The scheduler must swap adapters in and out of
the slots between steps, evicting only adapters with no running requests."""

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
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids

SLOTS = 2
ROTATION = ["kinds/rank4", "kinds/rank8", "kinds/rank16", "kinds/rank64", "kinds/qv-only", "kinds/rslora"]
ROUNDS = 3
PHASE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "adapters-slots", max_active_adapters=SLOTS)
    yield stack
    stack.stop()


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _request(client, model: str | None, prompt):
    common = dict(model=model or SERVED_NAME, max_tokens=MAX_TOKENS, temperature=0, extra_body=RETURN_TOKEN_IDS)
    if isinstance(prompt, str):
        return await client.completions.create(prompt=prompt, **common)
    return await client.chat.completions.create(messages=prompt, **common)


def _check(adapters, model: str | None, prompt, response, context: str) -> None:
    prompt_ids = completion_ids(adapters, prompt) if isinstance(prompt, str) else chat_ids(adapters, prompt)
    assert prompt_token_ids(response) == prompt_ids, context
    reference.assert_greedy_parity(token_ids(response), peft_greedy(adapters, model, prompt_ids), context)
    assert response.model == (model or SERVED_NAME), context


def _rotation(rounds: int) -> list[tuple[str | None, object]]:
    """Round after round, each of the six adapters in turn (a different prompt each time), the base
    model in between: more distinct adapters than slots, so each round evicts."""
    prompts = [*COMPLETION_PROMPTS, CHAT]
    out: list[tuple[str | None, object]] = []
    for r in range(rounds):
        for i, model in enumerate(ROTATION):
            out.append((model, prompts[(r + i) % len(prompts)]))
        out.append((None, prompts[r % len(prompts)]))
    return out


def _run(stack, requests, concurrent: bool):
    async def main():
        async with _client(stack) as client:
            if concurrent:
                return await asyncio.gather(*(_request(client, m, p) for m, p in requests))
            return [await _request(client, m, p) for m, p in requests]

    try:
        return asyncio.run(asyncio.wait_for(main(), PHASE_TIMEOUT_S))
    except TimeoutError:
        pytest.fail(f"{len(requests)} requests over {SLOTS} slots did not finish in {PHASE_TIMEOUT_S}s "
                    f"(deadlock?)\n--- stack log tail ---\n{stack.log()[-4000:]}")


def test_rotation_one_at_a_time_equals_peft(adapters, stack):
    """Every request needs an adapter that is not in a slot (the last two used are): an eviction
    and a copy per request."""
    requests = _rotation(2)
    for (model, prompt), response in zip(requests, _run(stack, requests, concurrent=False), strict=True):
        _check(adapters, model, prompt, response, f"sequential {model or 'base'} {prompt!r}")


def test_rotation_all_at_once_equals_peft(adapters, stack):
    """Several rounds of the rotation sent at once: requests of adapters that cannot get a slot
    wait while the others decode; all finish, all equal peft."""
    requests = _rotation(ROUNDS)
    with PeakRunning(stack, "quiver_adapters_active") as active, PeakRunning(stack) as running:
        responses = _run(stack, requests, concurrent=True)
    for (model, prompt), response in zip(requests, responses, strict=True):
        _check(adapters, model, prompt, response, f"concurrent {model or 'base'} {prompt!r}")
    # The server really worked with two slots, and really ran requests side by side.
    assert stack.metrics()["quiver_adapter_slots"] == SLOTS
    assert 1 <= active.value <= SLOTS, f"{active.value} adapters active at once with {SLOTS} slots"
    assert running.value >= 2, f"at most {running.value} requests ran at once"


def test_bursts_on_every_adapter_at_once(adapters, stack):
    """Several requests per adapter, for all six, in one burst: no adapter's queue starves."""
    requests = [(model, prompt) for prompt in COMPLETION_PROMPTS for model in ROTATION]
    for (model, prompt), response in zip(requests, _run(stack, requests, concurrent=True), strict=True):
        _check(adapters, model, prompt, response, f"burst {model} {prompt!r}")
    assert stack.get("/health")[0] == 200
