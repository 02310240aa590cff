"""Every model family served end to end (launcher, router, shard) with its own chat template:
chat and completion greedy output equals transformers' on the same directory, token for token
(DESIGN.md's correctness rule), and the prompt the router renders equals `apply_chat_template`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import reference
from conftest import SHARD_ENV
from model_builders import FAMILY_ARCHS, build_model_dir, family_chat_template
from served import RETURN_TOKEN_IDS, prompt_token_ids, token_ids
from stack import Stack, StackConfig

MAX_TOKENS = 12
CHATS: list[list[Any]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Köln."},
     {"role": "user", "content": "東京?"}],
]


class FamilyStacks:
    """One stack per family, started on first use, all stopped at the module's end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stacks: dict[str, tuple[Path, Stack]] = {}

    def get(self, arch: str) -> tuple[Path, Stack]:
        if arch not in self.stacks:
            model_dir = build_model_dir(arch, self.root / arch, seed=FAMILY_ARCHS.index(arch) + 11,
                                        eos_boost=2.5, chat_template=family_chat_template(arch))
            config = StackConfig(model_id=str(model_dir), served_model_name=f"tiny-{arch}", max_total_tokens=1536,
                                 extra_env=SHARD_ENV)
            self.stacks[arch] = (model_dir, Stack(config, self.root / f"{arch}.log").start())
        return self.stacks[arch]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyStacks]:
    pool = FamilyStacks(tmp_path_factory.mktemp("families"))
    yield pool
    for _, stack in pool.stacks.values():
        stack.stop()


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_chat_and_completion_equal_transformers(stacks: FamilyStacks, arch: str) -> None:
    model_dir, stack = stacks.get(arch)
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for messages in CHATS:
        response = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body=RETURN_TOKEN_IDS)
        prompt_ids = reference.chat_prompt_ids(str(model_dir), messages)
        assert prompt_token_ids(response) == prompt_ids, f"{arch}: the template rendered differently"
        expected = reference.greedy(str(model_dir), prompt_ids, MAX_TOKENS)
        reference.assert_greedy_parity(token_ids(response), expected, f"{arch} chat {messages}")
    prompt = "The quick brown fox"
    completion = client.completions.create(model=f"tiny-{arch}", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=RETURN_TOKEN_IDS)
    prompt_ids = reference.completion_prompt_ids(str(model_dir), prompt)
    assert prompt_token_ids(completion) == prompt_ids
    expected = reference.greedy(str(model_dir), prompt_ids, MAX_TOKENS)
    reference.assert_greedy_parity(token_ids(completion), expected, f"{arch} completion")


GRANITE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 3}}}}}]


def test_granite_writes_and_reads_calls_in_its_own_format(stacks: FamilyStacks) -> None:
    """Granite 3.2's published template is detected as Granite's call format (`<|tool_call|>`
    then a JSON list): a forced call on the random model comes back as `tool_calls` whose
    arguments validate against the tool's schema, whole and streamed alike."""
    import jsonschema

    _, stack = stacks.get("granite")
    status, info = stack.get("/info")
    assert status == 200 and b'"tool_call_parser":"granite"' in info
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    request: dict[str, Any] = {"model": "tiny-granite", "messages": CHATS[0], "tools": GRANITE_TOOLS,
                               "tool_choice": "required", "max_tokens": 200, "seed": 3, "temperature": 1.0}
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = choice.message.tool_calls or []
    assert calls and all(call.type == "function" for call in calls)
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), GRANITE_TOOLS[0]["function"]["parameters"])
    streamed: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or "" if delta.function else ""
            entry["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == [
        (call.function.name, call.function.arguments) for call in calls]
