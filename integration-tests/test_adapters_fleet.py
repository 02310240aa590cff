"""Issue 31, "thousands of adapters": one server, 1,000 peft adapters of ranks 4 to 64, 32 device
slots in four rank classes (8 slots each of rank 8, 16, 32 and 64: `--lora-rank-classes`) and a
host-memory cache of 16 adapters.

Every adapter is requested once, 12 requests in flight, so each one is loaded from disk, copied
into a slot (evicting an idle one) and served while others decode. Then:

* all 1,000 answer, and a sample of 20 (every rank and target set) equals peft's greedy output
  token for token, both on first use and again after host memory evicted them (read from disk
  a second time);
* nothing leaks: every KV block is free, nothing runs or waits, no request failed, at most 32
  slots ever held an adapter, and the per-adapter metric series stay bounded;
* host memory stays bounded: the shard's resident memory grows by far less than the adapters it
  loaded weigh (see `test_shard_memory_is_bounded_by_the_host_cache` for the bound);
* `/v1/models` lists all 1,000 and `/v1/models/{id}` answers for the sample.

The adapters are written by peft's own `save_pretrained`, one PeftModel per kind whose LoRA
weights are redrawn from a seeded generator before each save (that keeps writing 1,000 adapters
to seconds). The reference is transformers + peft in float32 on CPU.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import reference
from adapter_models import (
    ALL_PROJECTIONS,
    BASE_SEED,
    SERVED_NAME,
    greedy_with,
    randomise_lora,
    start_adapter_stack,
)
from model_builders import build_model_dir
from reliability_checks import wait_idle
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids
from stack import Stack

FLEET_SIZE = 1000
SLOTS = 32
HOST_CACHE = 16
IN_FLIGHT = 12
# Short prompts and answers: the test is about adapter churn, not decoding.
PROMPTS = ["Hello", "The quick brown fox"]
MAX_TOKENS = 3
FLEET_SEED = 5000

# Adapter i has kind i % 8: ranks 4 to 64, several alphas, rsLoRA, partial target sets.
FLEET_KINDS: list[dict[str, Any]] = [
    {"r": 4, "lora_alpha": 8, "target_modules": ALL_PROJECTIONS},
    {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    {"r": 12, "lora_alpha": 12, "target_modules": ALL_PROJECTIONS},
    {"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL_PROJECTIONS},
    {"r": 24, "lora_alpha": 48, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    {"r": 32, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS},
    {"r": 48, "lora_alpha": 24, "target_modules": ALL_PROJECTIONS},
    {"r": 64, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS},
]
# 20 adapters covering every kind (47 is odd, so i * 47 + 3 runs through every residue mod 8), all
# requested at least 100 adapters before the end of the cycle: by then they hold no slot and have
# left host memory, so asking for them again reads them from disk.
SAMPLE = [3 + 47 * i for i in range(20)]
# Adapters served before the shard's memory is first measured: the slots and the host cache are
# full by then, so what follows is the steady state of a cycling server.
WARM = 2 * SLOTS
PHASE_TIMEOUT_S = 600
# /metrics is read while the fleet cycles after every this many answers.
SCRAPE_EVERY = 25
# --metrics-max-adapter-labels: the first this many adapters get a label of their own in /metrics,
# all later ones share "other".
MAX_ADAPTER_LABELS = 32
# Two kinds of FLEET_KINDS per class; the 8 slots left over hold --max-lora-rank (64).
RANK_CLASSES = "8:8,16:8,32:8"


def fleet_id(index: int) -> str:
    return f"fleet/{index:04d}-r{FLEET_KINDS[index % len(FLEET_KINDS)]['r']}"


def fleet_prompt(index: int) -> str:
    # Every kind gets both prompts (not index % 2: kinds and prompts would pair up).
    return PROMPTS[(index // len(FLEET_KINDS)) % len(PROMPTS)]


@dataclass(frozen=True)
class Fleet:
    base_dir: Path
    root: Path

    def adapter_dir(self, index: int) -> Path:
        return self.root / fleet_id(index)

    def weight_bytes(self, index: int) -> int:
        """Bytes of the adapter's tensors (float32 on disk and in the float32 server)."""
        return (self.adapter_dir(index) / "adapter_model.safetensors").stat().st_size

    def prompt_ids(self, index: int) -> list[int]:
        return reference.completion_prompt_ids(str(self.base_dir), fleet_prompt(index))

    def peft_greedy(self, index: int) -> reference.Greedy:
        """peft's greedy answer to adapter `index`'s prompt."""
        return greedy_with(self.base_dir, self.adapter_dir(index), self.prompt_ids(index), MAX_TOKENS)

    def base_greedy(self, index: int) -> reference.Greedy:
        """The bare base's greedy answer to adapter `index`'s prompt."""
        return greedy_with(self.base_dir, None, self.prompt_ids(index), MAX_TOKENS)


def build_fleet(tmp: Path) -> Fleet:
    base_dir = build_model_dir("llama", tmp / "base", seed=BASE_SEED)
    root = tmp / "root"
    for kind, config in enumerate(FLEET_KINDS):
        # get_peft_model wraps the base in place: a fresh base per kind.
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **config))
        for index in range(kind, FLEET_SIZE, len(FLEET_KINDS)):
            randomise_lora(model, FLEET_SEED + index)
            model.save_pretrained(str(root / fleet_id(index)))
    return Fleet(base_dir=base_dir, root=root)


def shard_rss_bytes(stack: Stack) -> int:
    """Resident memory of the (single) shard process, from /proc/<pid>/status."""
    shards = [pid for pid, cmdline in stack.descendants() if "quiver-server" in cmdline and " serve" in cmdline]
    assert len(shards) == 1, f"expected one shard process below the launcher: {stack.descendants()}"
    status = Path(f"/proc/{shards[0]}/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(kib) * 1024


def _labelled(metrics: dict[str, float], family: str) -> dict[str, float]:
    """The series of `family` that carry an adapter label, by their printed name."""
    return {name: value for name, value in metrics.items() if name.startswith(family + "{")}


async def _send_all(stack: Stack, indices: list[int], in_flight: int,
                    scrapes: list[dict[str, float]] | None = None) -> list[Any]:
    """One greedy completion per adapter index, `in_flight` at a time, answered in order. With
    `scrapes`, /metrics is read after every SCRAPE_EVERY-th answer, while the others run."""
    gate = asyncio.Semaphore(in_flight)
    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:

        async def one(position: int, index: int) -> Any:
            async with gate:
                response = await client.completions.create(
                    model=fleet_id(index), prompt=fleet_prompt(index), max_tokens=MAX_TOKENS, temperature=0,
                    extra_body=RETURN_TOKEN_IDS)
            if scrapes is not None and position % SCRAPE_EVERY == 0:
                scrapes.append(await asyncio.to_thread(stack.metrics))
            return response

        return await asyncio.gather(*(one(position, index) for position, index in enumerate(indices)))


def _run(stack: Stack, indices: list[int], in_flight: int,
         scrapes: list[dict[str, float]] | None = None) -> list[Any]:
    try:
        return asyncio.run(asyncio.wait_for(_send_all(stack, indices, in_flight, scrapes), PHASE_TIMEOUT_S))
    except TimeoutError:
        pytest.fail(f"{len(indices)} requests did not finish in {PHASE_TIMEOUT_S}s (deadlock?)\n"
                    f"--- stack log tail ---\n{stack.log()[-4000:]}")


def _slot_holders(metrics: dict[str, float]) -> list[str]:
    """The adapters on the device, from the Gateway API Inference Extension's LoRA gauge."""
    (series,) = [name for name in metrics if name.startswith("vllm:lora_requests_info{")]
    match = re.search(r'running_lora_adapters="([^"]*)"', series)
    assert match, series
    return [adapter for adapter in match.group(1).split(",") if adapter]


def _assert_answered(fleet: Fleet, index: int, response: Any) -> None:
    ids = token_ids(response)
    choice = response.choices[0]
    context = f"{fleet_id(index)}: {ids} {choice.finish_reason}"
    assert response.model == fleet_id(index), context
    assert prompt_token_ids(response) == fleet.prompt_ids(index), context
    assert 1 <= len(ids) <= MAX_TOKENS and response.usage.completion_tokens == len(ids), context
    ended = ids[-1] == reference.load_tokenizer(str(fleet.base_dir)).eos_token_id
    assert choice.finish_reason == ("stop" if ended else "length") and (ended or len(ids) == MAX_TOKENS), context


def _assert_sample_equals_peft(fleet: Fleet, responses: dict[int, Any], when: str) -> None:
    for index in SAMPLE:
        reference.assert_greedy_parity(token_ids(responses[index]), fleet.peft_greedy(index),
                                       f"{fleet_id(index)} {when}")


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    return build_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def stack(fleet, tmp_path_factory) -> Iterator[Stack]:
    stack = start_adapter_stack(fleet.base_dir, fleet.root, tmp_path_factory.mktemp("logs"), "adapters-fleet",
                                max_active_adapters=SLOTS,
                                extra_args=["--max-cpu-adapters", str(HOST_CACHE), "--lora-rank-classes", RANK_CLASSES,
                                            "--metrics-max-adapter-labels", str(MAX_ADAPTER_LABELS)])
    yield stack
    stack.stop()


@dataclass(frozen=True)
class Cycle:
    """What one pass over the whole fleet left behind."""

    responses: dict[int, Any]  # adapter index -> its completion
    before: dict[str, float]  # /metrics when the stack was idle before the pass
    during: list[dict[str, float]]  # /metrics read while requests ran
    after: dict[str, float]  # /metrics when it was idle again after it
    rss_warm: int  # the shard's resident bytes after the first WARM adapters
    rss_after: int  # and after all of them


@pytest.fixture(scope="module")
def cycle(fleet, stack) -> Cycle:
    """Every adapter once, in order, IN_FLIGHT at a time; the shard's memory measured once the
    first WARM adapters have filled the slots and the host cache, and again at the end."""
    before = wait_idle(stack)
    responses: dict[int, Any] = {}
    during: list[dict[str, float]] = []
    warm = list(range(WARM))
    responses.update(zip(warm, _run(stack, warm, IN_FLIGHT, during), strict=True))
    wait_idle(stack)
    rss_warm = shard_rss_bytes(stack)
    rest = list(range(WARM, FLEET_SIZE))
    responses.update(zip(rest, _run(stack, rest, IN_FLIGHT, during), strict=True))
    after = wait_idle(stack)
    return Cycle(responses, before, during, after, rss_warm, shard_rss_bytes(stack))


# ---- tests --------------------------------------------------------------------------------------


def test_the_sampled_adapters_change_the_reference_output(fleet):
    """Guards the parity tests' power: peft's answers for the sample differ from the base's and
    from one another, so serving the base or another adapter's slot in their place cannot pass."""
    answers = {index: tuple(fleet.peft_greedy(index).token_ids) for index in SAMPLE}
    as_base = [index for index in SAMPLE if list(answers[index]) == fleet.base_greedy(index).token_ids]
    assert not as_base, f"sampled adapters that answer as the base does: {as_base}"
    assert len(set(answers.values())) == len(SAMPLE), f"two sampled adapters answer alike: {answers}"


def test_every_adapter_answers_and_the_sample_equals_peft(fleet, cycle):
    assert sorted(cycle.responses) == list(range(FLEET_SIZE))
    for index, response in cycle.responses.items():
        _assert_answered(fleet, index, response)
    _assert_sample_equals_peft(fleet, cycle.responses, "on first use")
    finished = cycle.after["quiver_requests_finished_total"] - cycle.before["quiver_requests_finished_total"]
    assert finished == FLEET_SIZE
    assert cycle.after["quiver_requests_failed_total"] == 0


def test_nothing_leaks_and_slots_stay_bounded(cycle):
    after = cycle.after
    # wait_idle returned this scrape: every KV block free, nothing running or waiting.
    assert after["quiver_kv_blocks_free"] == after["quiver_kv_blocks_total"] > 0
    assert after["quiver_requests_running"] == after["quiver_requests_waiting"] == 0
    assert after["quiver_adapter_slots"] == SLOTS
    active = [metrics["quiver_adapters_active"] for metrics in cycle.during]
    assert max(active) <= SLOTS, f"more adapters than slots on the device: {active}"
    running = [metrics["quiver_requests_running"] for metrics in cycle.during]
    assert max(running) >= 2, f"the requests never ran side by side: {running}"
    # 1,000 distinct adapters went through the slots: full now, and each was copied in once. What
    # they hold is what was used last (idle slots are taken least recently used first).
    assert after["quiver_adapters_active"] == SLOTS
    holders = _slot_holders(after)
    last = {fleet_id(index) for index in range(FLEET_SIZE - SLOTS - IN_FLIGHT, FLEET_SIZE)}
    assert len(holders) == SLOTS and set(holders) <= last, holders
    activations = _labelled(after, "quiver_adapter_activations_total")
    assert sum(activations.values()) == FLEET_SIZE, activations
    evictions = _labelled(after, "quiver_adapter_evictions_total")
    assert sum(evictions.values()) == FLEET_SIZE - SLOTS, evictions
    hits, misses = after["quiver_adapter_host_cache_hits_total"], after["quiver_adapter_host_cache_misses_total"]
    print(f"activations: {hits:.0f} found in host memory, {misses:.0f} read from disk again")
    assert hits + misses == FLEET_SIZE
    # Per-adapter series: the first MAX_ADAPTER_LABELS adapters by id, all others as "other".
    for family in ("quiver_adapter_activations_total", "quiver_adapter_evictions_total"):
        series = _labelled(after, family)
        assert len(series) <= MAX_ADAPTER_LABELS + 1, f"{family}: {len(series)} series"
    assert after['quiver_adapter_activations_total{adapter="other"}'] == FLEET_SIZE - MAX_ADAPTER_LABELS


def test_shard_memory_is_bounded_by_the_host_cache(fleet, cycle):
    """The host cache holds --max-cpu-adapters adapters besides the ones in slots (pinned there,
    they do not count), plus the few being read or copied at that moment (one activation, one read
    by each of the shard's two loader threads): here at most 16 + 32 + 3 = 51. Between the two
    measurements the shard read 936 more adapters; had it kept them, its memory would have grown
    by their full weight (about 180 MiB). The bound lets the whole cache turn over to the largest
    adapters of the fleet (51 x 512 KiB), plus 32 MiB for allocator slack and the records the
    shard keeps of every adapter (its directory and rank: about a kilobyte each)."""
    cached_at_most = HOST_CACHE + SLOTS + 3
    largest = max(fleet.weight_bytes(index) for index in range(len(FLEET_KINDS)))
    bound = cached_at_most * largest + 32 * 2**20
    read_since = sum(fleet.weight_bytes(index) for index in range(WARM, FLEET_SIZE))
    grown = cycle.rss_after - cycle.rss_warm
    print(f"shard RSS {cycle.rss_warm / 2**20:.1f} -> {cycle.rss_after / 2**20:.1f} MiB "
          f"(grew {grown / 2**20:.1f}, bound {bound / 2**20:.1f}, adapters read since {read_since / 2**20:.1f} MiB)")
    assert bound < read_since / 2, "the bound would not tell a cache that keeps every adapter"
    assert grown <= bound, (f"the shard grew by {grown / 2**20:.1f} MiB while cycling (bound {bound / 2**20:.1f} "
                            f"MiB; the adapters read weigh {read_since / 2**20:.1f} MiB)")


def test_evicted_adapters_are_read_again_and_still_equal_peft(fleet, stack, cycle):
    """The sample, again and all at once: none holds a slot or is in host memory any more, so each
    one is read from disk again (a host-cache miss apiece) and still answers as peft does."""
    before = wait_idle(stack)
    responses = dict(zip(SAMPLE, _run(stack, SAMPLE, len(SAMPLE)), strict=True))
    after = wait_idle(stack)
    for index, response in responses.items():
        _assert_answered(fleet, index, response)
    _assert_sample_equals_peft(fleet, responses, "read from disk again")
    activated = (sum(_labelled(after, "quiver_adapter_activations_total").values())
                 - sum(_labelled(before, "quiver_adapter_activations_total").values()))
    assert activated == len(SAMPLE)
    misses = after["quiver_adapter_host_cache_misses_total"] - before["quiver_adapter_host_cache_misses_total"]
    assert misses == len(SAMPLE), f"{misses} of {len(SAMPLE)} activations read the adapter from disk again"
    assert after["quiver_kv_blocks_free"] == after["quiver_kv_blocks_total"]
    assert after["quiver_adapters_active"] == SLOTS


def test_models_lists_the_whole_fleet(fleet, stack, cycle):
    status, body = stack.get("/v1/models")
    assert status == 200
    data = json.loads(body)["data"]
    assert data[0]["id"] == SERVED_NAME
    cards = {card["id"]: card for card in data[1:]}
    assert sorted(cards) == sorted(fleet_id(index) for index in range(FLEET_SIZE)), "not every adapter is listed"
    for card in cards.values():
        assert card["object"] == "model" and card["parent"] == SERVED_NAME and card["root"] == card["id"], card
    for index in SAMPLE:
        status, body = stack.get(f"/v1/models/{fleet_id(index)}")
        assert status == 200
        assert json.loads(body) == cards[fleet_id(index)]


def test_the_official_sdk_pages_through_the_whole_fleet(fleet, stack, cycle):
    """`limit`/`after` pages, read with the OpenAI SDK, give the whole list in order: each card
    once, none skipped (docs/api.md, "Listing models in pages")."""
    status, body = stack.get("/v1/models")
    assert status == 200
    whole = [card["id"] for card in json.loads(body)["data"]]
    paged: list[str] = []
    after: str | None = None
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0) as client:
        while True:
            query: dict[str, Any] = {"limit": 300, **({"after": after} if after else {})}
            page = client.models.list(extra_query=query)
            ids = [model.id for model in page.data]
            assert 0 < len(ids) <= 300
            paged += ids
            raw = page.model_extra or {}
            assert (raw["first_id"], raw["last_id"]) == (ids[0], ids[-1])
            if not raw["has_more"]:
                break
            after = raw["last_id"]
    assert paged == whole and len(whole) == FLEET_SIZE + 1


def test_the_slots_hold_the_rank_classes_asked_for(stack, cycle):
    """--lora-rank-classes reached the shard: three classes of 8 slots, the other 8 at rank 64
    (and every adapter above ran in a slot that holds its rank: the shard refuses any other)."""
    assert "adapter slots: 8 of rank up to 8, 8 of rank up to 16, 8 of rank up to 32, 8 of rank up to 64" in stack.log()
