"""Writes quiver's tiny model: a random-weight Llama with a real tokenizer and chat template.

It was the demo before the demo became a real model (quiver_server/demo); the tests that need a
fast model with a ChatML-with-tools template use it (`quiver-server tiny-model DIR`). Its answers
are random text; what is real is everything around the weights: a byte-level BPE
tokenizer (trained here, from text that ships with Python), ChatML special tokens and template,
EOS ids in generation_config.json, and the files laid out exactly as `save_pretrained` writes
them, so the whole serving path is exercised as with a hub model.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import inspect
import io
import logging
import os
from pathlib import Path

from quiver_server.staged_dir import write_staged

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

# ChatML with tools, in the manner of Qwen2.5's template (our own wording): declared `tools` go
# into the system turn as JSON lines inside <tools></tools>; an assistant turn's `tool_calls`
# become <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks, printing `arguments` as
# given when it is a string (OpenAI sends a JSON string) and as JSON otherwise; consecutive
# `tool` results share one user turn, each in a <tool_response> block. `content` may be null
# or absent (a tool-call turn) and renders as empty text.
CHATML_TEMPLATE = (
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- set system_text = (messages[0].content or '') if has_system else '' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_text -%}{{- system_text + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nThese functions are available; call any that help answer. "
    "Their JSON signatures:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with a <tool_call></tool_call> block per call, "
    "holding a JSON object with its name and arguments:\\n<tool_call>\\n"
    "{\"name\": <function name>, \"arguments\": <JSON object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (function.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if function.arguments is string -%}{{- function.arguments -}}"
    "{%- else -%}{{- function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Shapes: small enough to generate in a second and serve fast on a laptop CPU, large enough to
# have several heads, grouped-query attention and more than one layer.
VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 384
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 4096

# A little hand-written text (including non-ASCII, so common multi-byte sequences get merges)
# to go with the standard library's docstrings.
_OWN_TEXT = """\
quiver serves one base language model and any number of LoRA adapters behind an
OpenAI-compatible HTTP API. This is its demo model. Its weights are random numbers, so it
answers with random text; it exists so that you can try the server, the API and the tooling
before you download a real model.

The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. Tell me a joke. Why did the chicken cross the road? To get to the other
side. The user asks a question and the assistant answers it, one token at a time.

Café, naïve, résumé, façade, jalapeño, Größe, Straße, smörgåsbord. Ça va? ¿Qué tal? Grüß Gott!
Привет, мир. Γειά σου κόσμε. 你好，世界。こんにちは世界。안녕하세요. 👋 🎉 ✓ — « » “ ” ‘ ’ …
"""

# Modules whose docstrings (module, public functions and classes) are English prose that ships
# with every Python, so training needs no download.
_DOC_MODULES = (
    "argparse", "json", "collections", "functools", "itertools", "textwrap", "string", "pathlib",
    "dataclasses", "contextlib", "heapq", "bisect", "fractions", "statistics", "random", "difflib",
    "calendar", "csv", "shlex", "enum",
)


def training_corpus() -> list[str]:
    """Offline English text: our own paragraphs, the Zen of Python, and stdlib docstrings."""
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        import this
    texts = [_OWN_TEXT, codecs.decode(this.s, "rot13")]
    for name in _DOC_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr, value in vars(module).items():
            if attr.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isfunction(value) or inspect.isclass(value):
                texts.append(inspect.getdoc(value) or "")
    return [t for t in texts if t]


def train_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (GPT-2 style pre-tokenization) with ChatML special tokens at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any language, emoji) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer


def write_tiny_model(target_dir: str | os.PathLike[str], seed: int = 0) -> str:
    """Writes the tiny model into `target_dir` (which must not exist or be empty); returns its path.

    Files are written to a temporary sibling directory and renamed into place, so a reader that
    sees `target_dir` (the launcher checking its cache) always sees a complete model.
    """
    target = write_staged(target_dir, lambda staging: _write_files(staging, seed))
    logger.info("tiny model written to %s", target)
    return str(target)


def _write_files(out: Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(out)

    vocab = tokenizer.get_vocab()
    token_id = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=token_id[ENDOFTEXT],
        eos_token_id=token_id[IM_END],
        pad_token_id=token_id[ENDOFTEXT],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config = GenerationConfig(
        bos_token_id=token_id[ENDOFTEXT],
        # Like Qwen2 instruct models: the end of a turn or of the text both stop generation.
        eos_token_id=[token_id[IM_END], token_id[ENDOFTEXT]],
        pad_token_id=token_id[ENDOFTEXT],
    )
    model.save_pretrained(out)
    (out / "README.md").write_text(
        "# quiver tiny model\n\n"
        "A tiny Llama with **random weights**, written by `quiver-server tiny-model`: it answers\n"
        "with random text. The tokenizer (byte-level BPE, ChatML special tokens) is real, so the\n"
        "whole serving path works as with a real model. Serve a real model with\n"
        "`quiver-launcher --model-id <hub id or directory>`.\n"
    )
