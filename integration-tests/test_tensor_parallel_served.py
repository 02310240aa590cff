"""`--num-shard 2` on CPU through the real launcher: the model split over two shard processes
(gloo) serves, in one concurrent burst of base and adapter requests, the tokens and logprobs
(with their top alternatives) that `--num-shard 1` serves, within 1e-4, and transformers' and
peft's greedy tokens. The shard logs say which share each rank holds."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

import reference
from adapter_models import COMPLETION_PROMPTS, SERVED_NAME, adapter_set, completion_ids, greedy_with, start_stack
from served import RETURN_TOKEN_IDS, token_ids

MAX_TOKENS = 10
TOP = 5
ATOL = 1e-4
ADAPTERS = ["kinds/rank8", "kinds/every-linear"]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    adapters = adapter_set(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    one = start_stack(adapters, logs, "tp-one")
    two = start_stack(adapters, logs, "tp-two", extra_args=["--num-shard", "2"])
    yield adapters, one, two
    two.stop()
    one.stop()


def _burst(stack, jobs: list[tuple[str | None, str]]) -> list[Any]:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def burst() -> list[Any]:
        return await asyncio.gather(*(
            client.completions.create(model=model or SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=TOP, extra_body=RETURN_TOKEN_IDS)
            for model, prompt in jobs))

    return asyncio.run(burst())


def test_two_shards_serve_what_one_serves(stacks) -> None:
    _, one, two = stacks
    jobs = [(model, prompt) for model in [None, *ADAPTERS] for prompt in COMPLETION_PROMPTS]
    for (model, prompt), got, want in zip(jobs, _burst(two, jobs), _burst(one, jobs), strict=True):
        what = f"{model or 'base'} on {prompt!r}"
        assert token_ids(got) == token_ids(want), what
        got_lp, want_lp = got.choices[0].logprobs, want.choices[0].logprobs
        for a, b in zip(got_lp.token_logprobs, want_lp.token_logprobs, strict=True):
            assert abs(a - b) <= ATOL, what
        for a, b in zip(got_lp.top_logprobs, want_lp.top_logprobs, strict=True):
            assert a.keys() == b.keys(), what
            assert max(abs(a[k] - b[k]) for k in a) <= ATOL, what


def test_two_shards_serve_transformers_and_peft_tokens(stacks) -> None:
    adapters, _, two = stacks
    jobs = [(model, prompt) for model in [None, *ADAPTERS] for prompt in COMPLETION_PROMPTS]
    for (model, prompt), response in zip(jobs, _burst(two, jobs), strict=True):
        prompt_ids = completion_ids(adapters, prompt)
        want = greedy_with(adapters.base_dir, None if model is None else adapters.adapter_dir(model), prompt_ids,
                           MAX_TOKENS)
        reference.assert_greedy_parity(token_ids(response), want, f"{model or 'base'} on {prompt!r}, 2 shards")


def test_each_rank_says_which_share_it_holds(stacks) -> None:
    _, _, two = stacks
    log = two.log()
    assert "rank 0 of 2 joined the gloo group" in log and "rank 1 of 2 joined the gloo group" in log, log[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} read " in log and " MiB of the checkpoint's " in log, log[-3000:]


def test_metrics_show_each_rank_holding_half_the_weights(stacks) -> None:
    """/metrics names each rank's weight bytes: about half of what the one-shard server's rank
    holds (norms are whole on both, and packed layouts round widths up)."""
    _, one, two = stacks
    whole = one.metrics()['quiver_shard_weight_bytes{rank="0"}']
    split = two.metrics()
    assert 'quiver_shard_weight_bytes{rank="2"}' not in split
    for rank in (0, 1):
        share = split[f'quiver_shard_weight_bytes{{rank="{rank}"}}'] / whole
        assert 0.45 < share < 0.6, f"rank {rank} holds {share:.3f} of one rank's weight bytes"


def test_two_shards_embed_as_one_does(stacks) -> None:
    """Embeddings (the last token's hidden state, L2-normalized: the tiny base has no
    sentence-transformers files) on the base and an adapter: over two ranks, the vectors of one."""
    _, one, two = stacks

    def embed(stack, model: str | None) -> list[list[float]]:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.embeddings.create(model=model or SERVED_NAME, input=COMPLETION_PROMPTS,
                                          encoding_format="float")
        return [item.embedding for item in answer.data]

    for model in [None, ADAPTERS[1]]:
        for got, want in zip(embed(two, model), embed(one, model), strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= ATOL, model
            assert sum(a * b for a, b in zip(got, want, strict=True)) >= 0.9999, model
