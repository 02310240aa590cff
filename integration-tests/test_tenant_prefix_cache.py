"""Prefix-cache isolation (docs/multi-tenancy.md, "Prefix-cache isolation") on the real stack: a
cached prompt block is reused only by keys of the same prefix-cache group (one tenant's keys, or
tenants that name one group), and inside it only by requests that sent the same `cache_salt`;
without API keys the salt alone separates. Reuse is read from
`usage.prompt_tokens_details.cached_tokens` (streamed and not) and from the prefix-cache counters of
/metrics (through prometheus_client's parser); reused blocks still give transformers' greedy
tokens. A keys file with a bad tenant name stops start-up."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

import openai_schema
import reference
from conftest import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS, SHARD_ENV
from served import RETURN_TOKEN_IDS, token_ids
from stack import Stack, StackConfig, StackError
from tenant_keys import Caller, Key, write_keys_file

SERVED_NAME = "tiny-isolated"
MAX_TOKENS = 8
# A shared 2-core machine can take minutes to load the shard.
STARTUP_TIMEOUT_S = 300.0

A1 = Key("a1", "sk-isolated-a1", base_model=True, tenant="acme")
A2 = Key("a2", "sk-isolated-a2", base_model=True, tenant="acme")
B = Key("b", "sk-isolated-b", base_model=True, tenant="beta")
C = Key("c", "sk-isolated-c", base_model=True, tenant="gamma", prefix_cache_group="shared")
D = Key("d", "sk-isolated-d", base_model=True, tenant="delta", prefix_cache_group="shared")
KEYS = [A1, A2, B, C, D]


@dataclass(frozen=True)
class Served:
    stack: Stack
    model_dir: str
    model: str


@pytest.fixture(scope="module")
def isolated(pool, tmp_path_factory) -> Iterator[Served]:
    """The pool's tiny llama behind the keys above, prefix caching on."""
    model_dir = pool.model_dir("llama")
    tmp = tmp_path_factory.mktemp("tenant-prefix-cache")
    keys_file = tmp / "keys.yaml"
    write_keys_file(keys_file, KEYS)
    config = StackConfig(
        model_id=str(model_dir), served_model_name=SERVED_NAME, max_input_tokens=MAX_INPUT_TOKENS,
        max_total_tokens=MAX_TOTAL_TOKENS,
        # /metrics is read without a key, as a scraper on a firewalled port reads it.
        extra_env={**SHARD_ENV, "QUIVER_METRICS_OPEN": "true"},
        extra_args=["--prefix-caching", "true", "--api-keys-file", str(keys_file)],
    )
    stack = Stack(config, tmp / "isolated.log").start(timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield Served(stack, str(model_dir), SERVED_NAME)
    finally:
        stack.stop()


@pytest.fixture
def open_stack(llama) -> Served:
    """The pool's llama without API keys (prefix caching is on by default)."""
    return Served(llama.stack, str(llama.model_dir), llama.model)


def block_size(stack: Stack) -> int:
    status, body = stack.get("/info")
    assert status == 200, body
    return int(json.loads(body)["limits"]["block_size"])


def prompt_ids(served: Served, seed: int, blocks: int) -> list[int]:
    """`blocks` full KV blocks and a few tokens more, random ids above the special tokens."""
    vocab = len(reference.load_tokenizer(served.model_dir))
    rng = random.Random(seed)
    return [rng.randrange(8, vocab) for _ in range(blocks * block_size(served.stack) + 5)]


def reused_when_cached(stack: Stack, prompt_tokens: int) -> int:
    """What a repeated prompt finds cached: every full block but the one of its last token, which
    is computed to give the first token's logits."""
    block = block_size(stack)
    return (prompt_tokens - 1) // block * block


def cached(usage: CompletionUsage | None) -> int:
    assert usage is not None, "no usage"
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, "usage has no cached_tokens"
    return details.cached_tokens


def sdk(stack: Stack, key: Key | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key.key if key else "unused",
                         max_retries=0, timeout=120)


def prefix_cache_counters(stack: Stack) -> dict[str, float]:
    """Hits and queries, in prompt tokens, summed over every label set."""
    status, body = stack.get("/metrics")
    assert status == 200
    totals = {"quiver_prefix_cache_hits_total": 0.0, "quiver_prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


# One request of a reuse check: who sends it, its cache_salt (None: not sent), and whether it
# should find the prompt's full blocks cached.
Step = tuple[Key | None, str | None, bool]


def assert_reuse(served: Served, prompt: list[int], steps: list[Step]) -> None:
    """Sends `prompt` once per step, in order, and checks each answer's `cached_tokens`, its tokens
    against transformers, and that the counters grew by exactly what the answers report."""
    want = reference.greedy(served.model_dir, prompt, MAX_TOKENS)
    full = reused_when_cached(served.stack, len(prompt))
    before = prefix_cache_counters(served.stack)
    for i, (key, salt, hit) in enumerate(steps):
        context = f"step {i}: key {key.name if key else None}, cache_salt {salt!r}"
        extra = {**RETURN_TOKEN_IDS, **({"cache_salt": salt} if salt is not None else {})}
        with sdk(served.stack, key) as client:
            response = client.completions.create(model=served.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body=extra)
        assert response.usage is not None and response.usage.prompt_tokens == len(prompt), context
        assert cached(response.usage) == (full if hit else 0), context
        reference.assert_greedy_parity(token_ids(response), want, context)
    after = prefix_cache_counters(served.stack)
    hits = after["quiver_prefix_cache_hits_total"] - before["quiver_prefix_cache_hits_total"]
    queries = after["quiver_prefix_cache_queries_total"] - before["quiver_prefix_cache_queries_total"]
    assert hits == sum(full for _, _, hit in steps if hit)
    assert queries == len(steps) * len(prompt)


def test_keys_of_one_tenant_share_cached_blocks(isolated):
    assert_reuse(isolated, prompt_ids(isolated, 9001, blocks=4), [(A1, None, False), (A2, None, True)])


def test_another_tenant_finds_nothing_cached(isolated):
    assert_reuse(isolated, prompt_ids(isolated, 9002, blocks=4), [
        (A1, None, False),
        (B, None, False),
        (B, None, True),
        # acme's blocks were still there when beta missed them.
        (A2, None, True),
    ])


def test_tenants_naming_one_group_share_it_and_no_one_else(isolated):
    assert_reuse(isolated, prompt_ids(isolated, 9003, blocks=4), [
        (C, None, False),
        (D, None, True),
        (A1, None, False),
        (B, None, False),
    ])


def test_cache_salt_narrows_the_group_and_never_widens_it(isolated):
    assert_reuse(isolated, prompt_ids(isolated, 9004, blocks=4), [
        (A1, None, False),
        (A1, "x", False),
        (A1, "x", True),
        (A1, "y", False),
        # The tenant's other key with the same salt is inside the same group.
        (A2, "x", True),
        # The same salt from another tenant is not.
        (B, "x", False),
        # The unsalted blocks are still there.
        (A2, None, True),
    ])


def test_streamed_usage_reports_cached_tokens(isolated):
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You keep every answer short and plain. " * 6},
        {"role": "user", "content": "Name a river."},
    ]
    prompt = reference.chat_prompt_ids(isolated.model_dir, [dict(message) for message in messages])
    full = reused_when_cached(isolated.stack, len(prompt))
    assert full >= 2 * block_size(isolated.stack), "the chat must fill blocks"

    def streamed(key: Key, salt: str):
        with sdk(isolated.stack, key) as client:
            stream = client.chat.completions.create(
                model=isolated.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"cache_salt": salt},
            )
            usages = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usages) == 1, usages
        assert usages[0].prompt_tokens == len(prompt)
        return cached(usages[0])

    assert streamed(A1, "stream") == 0
    assert streamed(A1, "stream") == full
    assert streamed(A2, "stream") == full
    assert streamed(B, "stream") == 0
    assert streamed(A1, "other") == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_cache_salt_of_1_to_1024_bytes_is_accepted_and_others_refused(isolated, path):
    caller = Caller(isolated.stack.base_url, A1.key)
    try:
        def send(salt: str) -> httpx.Response:
            prompt = ({"prompt": "hi"} if path == "/v1/completions"
                      else {"messages": [{"role": "user", "content": "hi"}]})
            return caller.post(path, {"model": isolated.model, **prompt, "max_tokens": 1, "cache_salt": salt})

        for salt in ["", "é" * 512 + "x"]:  # 0 and 1025 bytes
            response = send(salt)
            assert response.status_code == 400, (len(salt.encode()), response.text)
            openai_schema.validate(response.json(), "ErrorResponse")
            assert response.json()["error"]["param"] == "cache_salt"
        for salt in ["s", "é" * 512]:  # 1 and 1024 bytes
            response = send(salt)
            assert response.status_code == 200, (len(salt.encode()), response.text)
    finally:
        caller.close()


def test_without_keys_the_salt_alone_separates(open_stack):
    assert_reuse(open_stack, prompt_ids(open_stack, 9005, blocks=3), [
        (None, "p", False),
        (None, "q", False),
        (None, "p", True),
        (None, None, False),
        (None, None, True),
        (None, "q", True),
    ])


@pytest.mark.parametrize("field", ["tenant", "prefix_cache_group"])
def test_a_bad_group_or_tenant_name_stops_start_up(pool, tmp_path: Path, field):
    keys_file = tmp_path / "keys.yaml"
    spaced = (Key("spaced", "sk-spaced", base_model=True, tenant="a b") if field == "tenant"
              else Key("spaced", "sk-spaced", base_model=True, prefix_cache_group="a b"))
    write_keys_file(keys_file, [spaced])
    config = StackConfig(
        model_id=str(pool.model_dir("llama")), served_model_name=SERVED_NAME, max_input_tokens=MAX_INPUT_TOKENS,
        max_total_tokens=MAX_TOTAL_TOKENS, extra_env=SHARD_ENV, extra_args=["--api-keys-file", str(keys_file)],
    )
    stack = Stack(config, tmp_path / "refused.log")
    with pytest.raises(StackError, match="launcher exited"):
        stack.start(timeout_s=STARTUP_TIMEOUT_S)
    assert stack.process.returncode != 0
    assert f"{field} `a b`" in stack.log(), stack.log()
