"""Writes `null-content-golden.json`: conversations whose assistant turn calls tools with
`content: null` (what the OpenAI SDKs, the Agents SDK and LangChain send, and what a Responses
tool round trip maps to), each with the rendering transformers' `apply_chat_template` gives,
for `router/tests/chat_template_golden.rs`.

transformers passes the null through as `None`, which a template written for string content
cannot use (`'…' + message['content']` raises; `{{ message['content'] | trim }}` prints "None").
quiver gives such templates "" instead (router/src/template/null_content.rs), so for them the
expected text is what transformers renders from the same messages with `content: ""`. Templates
that test the content (`is none`, `is string`, …) keep `None` in quiver, so for them the expected
text is transformers' rendering of the messages as they are. Which is which is written by hand in
`TEMPLATES`, not computed by quiver's rule: the golden is the independent reference the rule is
held to.

Run from the repository root:
    .venv/bin/python testdata/chat-templates/generate_null_content_golden.py
Made with transformers 5.23.0 and jinja2 3.1.6 (checked below, so a rerun states what it used).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jinja2
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).resolve().parent

# template file → how quiver hands the template a null content: "" or None (kept).
TEMPLATES: dict[str, str | None] = {
    "chatml-openhermes-2.5.json": "",  # plain ChatML: `'\n' + message['content']`
    "smollm2-instruct.json": "",  # the demo model's template (SmolLM2's GGUF), plain ChatML too
    "llama-3-instruct.json": "",  # `message['content'] | trim` prints "None"
    "qwen2-instruct.json": "",  # ChatML with a default system prompt
    "quiver-demo.json": "",  # `message.content or ''`: the same text either way
    "deepseek-r1.json": None,  # `message['content'] is none` picks the tool-call branch
    "llama-3.1-instruct.json": None,  # `message.content is mapping/iterable` (tool results)
    "qwen3.json": None,  # `message.content is string`
}

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
# (case, messages): the tool turns clients send, with the null content they send.
CASES: list[tuple[str, list[dict[str, Any]]]] = [
    ("tool_round_trip_null_content", [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "9 °C, rain"},
    ]),
    ("tool_round_trip_then_answer", [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "9 °C, rain"},
        {"role": "assistant", "content": "It is 9 °C and raining in Oslo."},
        {"role": "user", "content": "Thanks!"},
    ]),
]


def as_quiver_gives_it(messages: list[dict[str, Any]], null_as: str | None) -> list[dict[str, Any]]:
    given = copy.deepcopy(messages)
    for message in given:
        if message.get("content", "") is None:
            message["content"] = null_as
    return given


def render(spec: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """`render_jinja_template` (the code behind `apply_chat_template`), cross-checked against a
    tokenizer's `apply_chat_template` where the messages hold no `None`: transformers 5.23's
    `apply_chat_template` drops the keys whose value is `None` before rendering, which leaves
    `content` undefined (and the plain templates above fail on it as they fail on `None`)."""
    tokens = {key: spec[key] for key in ("bos_token", "eos_token") if spec.get(key) is not None}
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=spec["chat_template"],
                                        add_generation_prompt=add_generation_prompt, **tokens)
    if all(value is not None for message in messages for value in message.values()):
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **tokens)
        tokenizer.chat_template = spec["chat_template"]
        via_tokenizer = tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        assert rendered[0] == via_tokenizer, "render_jinja_template and apply_chat_template differ"
    return rendered[0]


def main() -> None:
    assert transformers.__version__ == "5.23.0" and jinja2.__version__ == "3.1.6"
    goldens = []
    for file, null_as in TEMPLATES.items():
        spec = json.loads((HERE / file).read_text(encoding="utf-8"))
        for case, messages in CASES:
            for prompt in (True, False):
                goldens.append({
                    "template": file, "case": case, "messages": messages, "tools": None,
                    "add_generation_prompt": prompt, "null_content_rendered_as": null_as,
                    "expected": render(spec, as_quiver_gives_it(messages, null_as), prompt),
                    "error": False,
                })
    text = json.dumps(goldens, ensure_ascii=False, indent=1) + "\n"
    (HERE / "null-content-golden.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
