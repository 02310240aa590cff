"""Tiny random-weight models with a real tokenizer, written with `save_pretrained`.

The tests serve these through the whole stack and compare against transformers loading the same
directory. The only quiver code used is the demo model's tokenizer trainer: the tokenizer is an
input to both sides, not part of the reference.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, processors
import transformers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from quiver_server.tiny_model import ENDOFTEXT, IM_END, IM_START, train_tokenizer

# The demo model's tokenizer (byte-level BPE with ChatML tokens), plus a BOS that
# `tokenizer(prompt)` prepends as Llama tokenizers do: completions must add it, chat prompts
# (whose template renders it) must not add it twice.
BOS = "<s>"
EOS = IM_END
PAD = ENDOFTEXT

# ChatML with bos_token rendered by the template. It raises for unknown roles and for a
# misplaced system message, as many real templates do, so the tests can check that
# raise_exception becomes a 400.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('The system message must come first') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = train_tokenizer(vocab_size)
    # Few merges cover CJK and emoji, so their tokens split UTF-8 characters: streamed text must
    # still never carry half a character.
    tok.add_special_tokens([BOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    # `convert_tokens_to_ids` is typed for a list of tokens as well; the vocabulary is plain.
    return tokenizer.get_vocab()[token]


def _config(arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        # Larger than the usual 0.02 so that logits are spread out: ties within 1e-4 (which the
        # correctness rule would excuse) stay rare and the test compares real decisions.
        initializer_range=0.1,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "mistral":
        # Mistral 7B v0.1's window; longer than any test sequence, so it changes no result.
        return MistralConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             sliding_window=4096)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                           use_sliding_window=False)
    if arch in _FAMILY_CONFIGS:
        config_class, extra = _FAMILY_CONFIGS[arch]
        return getattr(transformers, config_class)(**{**common, **extra})
    raise ValueError(f"unknown architecture {arch}")


# The families served end to end with their own chat templates: config class and what their tiny
# shape needs (16-wide heads where the family's default is wider, a few small experts).
_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", {}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "attention_multiplier": 0.2,
                                  "residual_multiplier": 0.5, "logits_scaling": 2.0}),
}
FAMILY_ARCHS = tuple(_FAMILY_CONFIGS)

# Each family's own chat template, from the repository's chat-template corpus (testdata/).
CHAT_TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "testdata" / "chat-templates"
FAMILY_TEMPLATES = {
    "qwen3": "qwen3.json",
    "qwen3_moe": "qwen3.json",
    "mixtral": "mixtral-8x7b-instruct-v0.1-original.json",
    "gemma2": "gemma-it.json",
    "gemma3_text": "gemma-3-it.json",
    "phi3": "phi-4.json",
    "granite": "granite-3.2-instruct.json",
}


def family_chat_template(arch: str) -> str:
    return json.loads((CHAT_TEMPLATES_DIR / FAMILY_TEMPLATES[arch]).read_text())["chat_template"]


def build_model_dir(arch: str, out_dir: Path, seed: int = 0, eos_boost: float = 0.0,
                    chat_template: str | None = None) -> Path:
    """Writes a tiny random `arch` model plus tokenizer to `out_dir` and returns it.

    `eos_boost` scales the EOS row of the LM head so that greedy decoding sometimes ends with
    EOS within a few tokens (random models otherwise almost never produce it). `chat_template`
    replaces the tokenizer's ChatML one (a family's own, `family_chat_template`).
    """
    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    vocab_size = len(tokenizer)
    eos_id = _token_id(tokenizer, EOS)
    config = _config(
        arch,
        vocab_size,
        bos_id=_token_id(tokenizer, BOS),
        eos_id=eos_id,
        pad_id=_token_id(tokenizer, PAD),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # q/k/v biases start at zero; random ones make sure the shard really applies them.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    if eos_boost:
        with torch.no_grad():
            model.lm_head.weight[eos_id] *= eos_boost
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_id, pad_token_id=config.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# What the parrot model says: multi-byte characters that the byte-level BPE splits over several
# tokens (CJK, an emoji, an umlaut), with no token repeated so the next token is a function of
# the current one.
PARROT_TEXT = "東京🙂Köln✨"


def build_parrot_model(out_dir: Path, text: str = PARROT_TEXT, added_tokens: Sequence[str] = (),
                       chat_template: str | None = None) -> Path:
    """A Llama whose greedy continuation of a prompt ending in a newline is exactly `text`, then
    EOS, whatever came before: attention and MLP outputs are zeroed, so the residual stream is
    the current token's embedding, and the LM head maps each token of the chain to the next.

    Its output is known in advance, so tests can check what a stream must contain character by
    character (no half UTF-8 character, no part of a stop string) without relying on random
    weights happening to produce such text.

    `added_tokens` become added (non-special) tokens of the tokenizer, as Qwen3's `<think>` and
    `</think>` are; `chat_template` replaces the ChatML one.
    """
    tokenizer = build_tokenizer()
    if added_tokens:
        tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    start = _token_id(tokenizer, "Ċ")  # "\n": the end of the chat generation prompt
    chain = [start, *tokenizer(text, add_special_tokens=False)["input_ids"], _token_id(tokenizer, EOS)]
    if len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"{text!r} repeats a token: the next token would not be a function of the last")
    config = _config("llama", len(tokenizer), bos_id=_token_id(tokenizer, BOS),
                     eos_id=chain[-1], pad_id=_token_id(tokenizer, PAD))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings.normal_(0.0, 1.0)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        # Token t's hidden state is (nearly) its normalised embedding: the row of its successor
        # is that embedding, so the successor's logit (~hidden_size) dwarfs every other (~±8).
        for current, successor in itertools.pairwise(chain):
            head[successor] = embeddings[current]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=chain[-1], pad_token_id=config.pad_token_id
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
