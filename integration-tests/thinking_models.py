"""Thinking "parrots" for the reasoning tests: tiny models whose greedy reply is known in advance
(model_builders.build_parrot_model), with the real chat templates of the testdata corpus and
Qwen3's thinking markers as added tokens, and the stacks that serve them.

    qwen3 parrot   Qwen3's template; after the generation prompt's "\\n" it says
                   `<think>{REASONING}</think>\\n\\n{ANSWER}`, the shape of a Qwen3 reply;
                   after "\\n\\n" (the end of the prompt with `enable_thinking: false`,
                   `<think>\\n\\n</think>\\n\\n`) it says ANSWER alone.
    r1 parrot      DeepSeek-R1's template, whose prompt ends `<think>\\n`; it says
                   `{REASONING}</think>\\n\\n{ANSWER}`, as R1 replies inside the opened block.

Qwen's BPE has "\\n\\n" as one token; the tiny tokenizer gets it as an added token, so that a
parrot (which never repeats a token) can write it and a prompt can end with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

import peft
import torch
from transformers import AutoModelForCausalLM

from model_builders import CHAT_TEMPLATE, CHAT_TEMPLATES_DIR, build_parrot_model
from stack import Stack, StackConfig

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
# Qwen3's added tokens that matter here, and Qwen's "\n\n".
ADDED_TOKENS = [THINK_START, THINK_END, TOOL_START, TOOL_END, "\n\n"]
REASONING = "Weigh it"
ANSWER = "Yes, sure!"
QWEN3_REPLY = f"{THINK_START}{REASONING}{THINK_END}\n\n{ANSWER}"
R1_REPLY = f"{REASONING}{THINK_END}\n\n{ANSWER}"
# An adapter with a template of its own that has no thinking markers (ChatML).
PLAIN_TEMPLATE_ADAPTER = "plain-template"
SHARD_ENV = {"OMP_NUM_THREADS": "1"}


def reasoning_of(message_or_delta: Any) -> str | None:
    """`reasoning_content`, which the SDK keeps as an extra field of a message or delta."""
    return (message_or_delta.model_extra or {}).get("reasoning_content")


def split_at_markers(reply: str, prompt_opened: bool) -> tuple[str | None, str | None]:
    """The reference split of a complete reply (vLLM's rule): the text between the markers, and
    the text after `</think>`, as written; `None` for an empty side."""
    thinking = reply if prompt_opened else reply.removeprefix(THINK_START)
    reasoning, _, content = thinking.partition(THINK_END)
    return reasoning or None, content or None


def corpus_template(name: str) -> str:
    """A chat template of the repository's corpus (testdata/chat-templates)."""
    return json.loads((CHAT_TEMPLATES_DIR / name).read_text())["chat_template"]


def build_qwen3_parrot(out_dir: Path) -> Path:
    return build_parrot_model(out_dir, QWEN3_REPLY, ADDED_TOKENS, corpus_template("qwen3.json"))


def build_r1_parrot(out_dir: Path) -> Path:
    return build_parrot_model(out_dir, R1_REPLY, ADDED_TOKENS, corpus_template("deepseek-r1.json"))


def build_plain_template_adapter(base_dir: Path, out_dir: Path) -> Path:
    """An untrained LoRA adapter (peft starts lora_B at zero: the replies stay the base's) that
    ships its own ChatML template, which shows no thinking markers."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out_dir


def start_parrot(model_dir: Path, log: Path, name: str, extra_args: list[str] | None = None) -> Stack:
    config = StackConfig(model_id=str(model_dir), served_model_name=name, max_input_tokens=512,
                         max_total_tokens=1024, extra_args=extra_args or [], extra_env=SHARD_ENV)
    return Stack(config, log).start()


@dataclass
class ThinkingStack:
    model_dir: Path
    stack: Stack
    model: str  # the served name

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def start_qwen3_parrot(root: Path) -> ThinkingStack:
    """The qwen3 parrot, with PLAIN_TEMPLATE_ADAPTER in a local adapter root."""
    model_dir = build_qwen3_parrot(root / "model")
    build_plain_template_adapter(model_dir, root / "adapters" / PLAIN_TEMPLATE_ADAPTER)
    stack = start_parrot(model_dir, root / "stack.log", "qwen3-parrot",
                         ["--adapter-source", "local", "--adapter-root", str(root / "adapters")])
    return ThinkingStack(model_dir, stack, "qwen3-parrot")


def start_r1_parrot(root: Path) -> ThinkingStack:
    model_dir = build_r1_parrot(root / "model")
    return ThinkingStack(model_dir, start_parrot(model_dir, root / "stack.log", "r1-parrot"), "r1-parrot")
