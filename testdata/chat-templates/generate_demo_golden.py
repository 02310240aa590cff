"""Regenerates `quiver-demo.json` and `demo-golden.json`: the demo model's chat template and its
renderings by transformers' `apply_chat_template`, for `router/tests/chat_template_golden.rs`.

Run from the repository root with the server package importable:
    PYTHONPATH=server .venv/bin/python testdata/chat-templates/generate_demo_golden.py
Made with transformers 5.23.0 and jinja2 3.1.6 (checked below, so a rerun states what it used).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from quiver_server.tiny_model import CHATML_TEMPLATE, ENDOFTEXT, IM_END

HERE = Path(__file__).resolve().parent
TEMPLATE_FILE = "quiver-demo.json"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "local_time", "description": "Local time in a time zone.",
                 "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` is a JSON string as OpenAI sends it, or a dict."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ASK = {"role": "user", "content": "Weather in Zürich and Oslo, and the time in Tokyo?"}
# (case, messages, tools): the shapes an OpenAI client sends for tool turns.
CASES: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ("single_user", [{"role": "user", "content": "Hello, how are you?"}], None),
    ("system_user", [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi"}], None),
    ("multi_turn", [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! 👋"},
                    {"role": "user", "content": "Tell me a \"joke\"\n\twith {{ braces }}."}], None),
    ("tools_declared", [{"role": "user", "content": "What can you do?"}], TOOLS),
    ("tools_with_system", [{"role": "system", "content": "Use tools when useful."}, ASK], TOOLS),
    ("tool_call_null_content", [
        ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", "get_weather", '{"city": "Zürich"}')]},
    ], TOOLS),
    ("multiple_tool_calls_no_content_key", [
        ASK,
        {"role": "assistant", "tool_calls": [
            call("c1", "get_weather", '{"city":"Zürich","unit":"c"}'),
            call("c2", "get_weather", {"city": "Oslo"}),
            call("c3", "local_time", "{}"),
        ]},
    ], TOOLS),
    ("tool_call_with_text", [
        ASK,
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [call("c1", "local_time", {"tz": "Asia/Tokyo"})]},
    ], TOOLS),
    ("tool_results_grouped", [
        {"role": "system", "content": "Use tools when useful."},
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            call("c1", "get_weather", '{"city": "Zürich"}'),
            call("c2", "get_weather", '{"city": "Oslo"}'),
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "c2", "content": "9 °C, rain"},
    ], TOOLS),
    ("tool_roundtrip_multi_turn", [
        ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "9 °C"},
        {"role": "assistant", "content": "It is 9 °C in Oslo."},
        {"role": "user", "content": "And Tokyo's time?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("c2", "local_time", '{"tz": "Asia/Tokyo"}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "18:05"},
    ], TOOLS),
    ("tool_history_without_tools", [
        ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "9 °C"},
    ], None),
]


def tokenizer_with_template() -> PreTrainedTokenizerFast:
    """A tokenizer carrying the template, for the cross-check through `apply_chat_template`."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()),
                                        eos_token=IM_END, pad_token=ENDOFTEXT)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           add_generation_prompt: bool, tokenizer: PreTrainedTokenizerFast) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                        chat_template=CHATML_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt)
    via_tokenizer = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
    assert rendered[0] == via_tokenizer, "render_jinja_template and apply_chat_template differ"
    return rendered[0]


def main() -> None:
    assert transformers.__version__ == "5.23.0" and jinja2.__version__ == "3.1.6"
    tokenizer = tokenizer_with_template()
    spec = {
        "name": "quiver demo model (ChatML with tools)",
        "source": "server/quiver_server/demo_model.py, CHATML_TEMPLATE (written for quiver)",
        "chat_template": CHATML_TEMPLATE,
        "bos_token": None,
        "eos_token": IM_END,
        "supports_tools": True,
        "supports_system": True,
    }
    goldens = [
        {"template": TEMPLATE_FILE, "case": case, "messages": messages, "tools": tools,
         "add_generation_prompt": prompt,
         "expected": render(messages, tools, prompt, tokenizer), "error": False}
        for case, messages, tools in CASES
        for prompt in (True, False)
    ]
    for name, data in ((TEMPLATE_FILE, spec), ("demo-golden.json", goldens)):
        text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
        (HERE / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
