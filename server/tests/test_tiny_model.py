"""The tiny model (the demo before it was a real model) loads with stock transformers, renders
ChatML and tokenizes any text losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from quiver_server.tiny_model import CHATML_TEMPLATE, write_tiny_model

# Text that breaks naive tokenizers: combining emoji, CJK, tabs, CR LF, quotes, braces.
TRICKY_USER = (
    "  Héllo, wörld! 你好，世界 👋🏽 — naïve café\nLine two has \"double\" and 'single' quotes, "
    "a tab\there, a backslash \\ and {{ braces }}.\n\n   indented line; trailing spaces follow   "
)
TRICKY_ASSISTANT = "\n  Réponse: «ok» — it's “fine” ✓ \n"
TRICKY_FOLLOW_UP = "  ¿Y ahora?\r\nÇa va? \"quoted\"  "

# (messages, add_generation_prompt, expected) written out from the ChatML format: each turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
# The same cases and renderings as the chatml-openhermes-2.5 entries of the shared golden.json.
CHATML_CASES = [
    (
        [{"role": "user", "content": "Hello, how are you?"}],
        True,
        "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        [{"role": "user", "content": "Hello, how are you?"}],
        False,
        "<|im_start|>user\nHello, how are you?<|im_end|>\n",
    ),
    (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        True,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        [
            {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        True,
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help you today?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        [
            {"role": "user", "content": TRICKY_USER},
            {"role": "assistant", "content": TRICKY_ASSISTANT},
            {"role": "user", "content": TRICKY_FOLLOW_UP},
        ],
        False,
        f"<|im_start|>user\n{TRICKY_USER}<|im_end|>\n<|im_start|>assistant\n{TRICKY_ASSISTANT}<|im_end|>\n"
        f"<|im_start|>user\n{TRICKY_FOLLOW_UP}<|im_end|>\n",
    ),
]

ROUND_TRIP_TEXTS = [
    TRICKY_USER,
    TRICKY_ASSISTANT,
    TRICKY_FOLLOW_UP,
    "Привет, мир. Γειά σου κόσμε. こんにちは世界。안녕하세요. 🇫🇷🧑‍🚀 \u200b zero-width, ﬁ ligature, e\u0301",
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}  # code\n",
    "",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_tiny_model(tmp_path_factory.mktemp("demo") / "model"))


def test_loads_with_transformers_and_generates(demo_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    config = model.config
    assert config.model_type == "llama"
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 64 <= config.hidden_size <= 128 and 2 <= config.num_hidden_layers <= 4
    assert 1000 <= config.vocab_size <= 2000 and len(tokenizer) <= config.vocab_size

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert config.eos_token_id == im_end
    generation_config = GenerationConfig.from_pretrained(demo_dir)
    assert set(generation_config.eos_token_id) == {im_end, endoftext}

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert int(out.max()) < config.vocab_size


def test_weights_are_random_but_reproducible(demo_dir: Path, tmp_path: Path) -> None:
    again = Path(write_tiny_model(tmp_path / "again"))
    first = AutoModelForCausalLM.from_pretrained(demo_dir).state_dict()
    second = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("messages,add_generation_prompt,expected", CHATML_CASES)
def test_chat_template_renders_chatml(
    demo_dir: Path, messages: list[dict[str, str]], add_generation_prompt: bool, expected: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected


def test_special_tokens_are_single_ids(demo_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\n"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_unicode(demo_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # The router loads tokenizer.json with the `tokenizers` library directly: same ids, same text.
    raw = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert raw.decode(ids, skip_special_tokens=False) == text


def test_refuses_to_overwrite_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_tiny_model(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_router_goldens_use_the_shipped_template(demo_dir: Path) -> None:
    """The router's demo goldens (testdata/chat-templates/demo-golden.json) were rendered from
    this template; if it changes, they must be regenerated with generate_demo_golden.py."""
    corpus = Path(__file__).resolve().parents[2] / "testdata" / "chat-templates"
    committed = json.loads((corpus / "quiver-demo.json").read_text(encoding="utf-8"))
    assert committed["chat_template"] == CHATML_TEMPLATE
    assert AutoTokenizer.from_pretrained(demo_dir).chat_template == CHATML_TEMPLATE
