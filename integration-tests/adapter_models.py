"""LoRA adapters for the adapter tests, written by `peft` itself, and `peft` as their reference.

One tiny Llama base (hidden 64, 2 layers) and one adapter root per test session:

    <tmp>/base/                      the base model (model_builders.build_model_dir)
    <tmp>/root/kinds/<kind>/         one adapter per ADAPTER_KINDS entry (local id "kinds/<kind>")
    <tmp>/root/template/own-template      an adapter with only its own chat_template.jinja
    <tmp>/root/template/own-tokenizer     an adapter with its own tokenizer files and template
    <tmp>/root/bad/...               adapters that do not fit the base (hidden size, rank) or are
                                     broken (no weights, no adapter_config.json)
    <tmp>/root/alias -> kinds/rank8  a symlink that stays inside the root (allowed)
    <tmp>/root/escape -> <tmp>/outside/evil   a symlink leaving the root (refused)

PEFT initialises lora_B to zero (an untrained adapter changes nothing), so both halves are redrawn
from a seeded generator at a scale that moves greedy tokens away from the base's: a wrong scaling,
a skipped module or a swapped slot then shows as different tokens. The only quiver code used is
the test tier's own stack launcher; the reference is transformers + peft in float32 on CPU.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import openai
import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding, LlamaConfig

import reference
from model_builders import CHAT_TEMPLATE, build_model_dir
from served import RETURN_TOKEN_IDS
from stack import Stack, StackConfig, StackError

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Issue 3's adapter kinds: kind -> peft.LoraConfig arguments. The local id is "kinds/<kind>".
ADAPTER_KINDS: dict[str, dict[str, Any]] = {
    "rank4": {"r": 4, "lora_alpha": 8, "target_modules": ALL_PROJECTIONS},
    "rank8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
    "rank16": {"r": 16, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
    "rank64": {"r": 64, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS},
    "qv-only": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    # peft's own spelling for "every linear layer but the head".
    "every-linear": {"r": 8, "lora_alpha": 8, "target_modules": "all-linear"},
    "mlp-only": {"r": 8, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    # alpha/sqrt(r) = 4 instead of alpha/r = 1: a server using the plain scaling gets other tokens.
    "rslora": {"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL_PROJECTIONS},
}

BASE_SEED = 11
# lora_B's scale: large enough that every kind changes greedy tokens of the test prompts (the
# tests check that), small enough that logits stay in a range where ties within 1e-4 are rare.
LORA_SCALE = 0.6
MAX_TOKENS = 12
SERVED_NAME = "tiny-base"

COMPLETION_PROMPTS = ["Hello", "The quick brown fox", "東京と大阪", "def add(a, b):"]
CHAT = [{"role": "user", "content": "Name a city."}]

# The adapters' own chat templates: the base's ChatML with a system preamble of their own, so the
# prompt token count shows which template rendered a chat.
PIRATE_TEMPLATE = (
    "{{ bos_token }}<|im_start|>system\nYou are a pirate. Answer like one.<|im_end|>\n" + CHAT_TEMPLATE[15:]
)
POET_TEMPLATE = (
    "{{ bos_token }}<|im_start|>system\nAnswer in verse, always.<|im_end|>\n" + CHAT_TEMPLATE[15:]
)
assert CHAT_TEMPLATE.startswith("{{ bos_token }}")

# torch's OpenMP workers busy-wait; one thread per shard keeps the 2-core box responsive.
SHARD_ENV = {"OMP_NUM_THREADS": "1"}


def randomise_lora(model: torch.nn.Module, seed: int, scale: float = LORA_SCALE) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                param.copy_(scale * torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)


def build_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_config: Any) -> Path:
    """A random LoRA adapter for the model in `base_dir`, written by peft's save_pretrained."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **lora_config))
    randomise_lora(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    return out_dir


def build_narrow_base(base_dir: Path, out_dir: Path) -> Path:
    """The base's architecture and vocabulary with hidden size 32 instead of 64: an adapter made
    for it must be refused by the 64-wide base."""
    config = LlamaConfig.from_pretrained(base_dir)
    config.hidden_size, config.intermediate_size = 32, 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def _forget_base_path(adapter_dir: Path) -> None:
    """Drops adapter_config.json's pointer to the base it was made for, so only the weights'
    shapes can tell that it does not fit."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = None
    path.write_text(json.dumps(config, indent=2))


@dataclass(frozen=True)
class AdapterSet:
    base_dir: Path
    root: Path
    outside: Path  # a valid adapter outside the root (reached only through the escaping symlink)

    def kind_id(self, kind: str) -> str:
        return f"kinds/{kind}"

    def adapter_dir(self, adapter_id: str) -> Path:
        return self.root / adapter_id


def _build(tmp: Path) -> AdapterSet:
    base_dir = build_model_dir("llama", tmp / "base", seed=BASE_SEED)
    root = tmp / "root"
    for i, (kind, config) in enumerate(ADAPTER_KINDS.items()):
        build_adapter(base_dir, root / "kinds" / kind, seed=100 + i, **config)

    # Own template only (the base's tokenizer), and own tokenizer files with another template.
    own = build_adapter(base_dir, root / "template" / "own-template", seed=200, **ADAPTER_KINDS["rank8"])
    (own / "chat_template.jinja").write_text(PIRATE_TEMPLATE)
    own_tok = build_adapter(base_dir, root / "template" / "own-tokenizer", seed=201, **ADAPTER_KINDS["qv-only"])
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = POET_TEMPLATE
    tokenizer.save_pretrained(own_tok)

    # Inside the root: the shard reads the config of the base an adapter names only there.
    narrow = build_narrow_base(base_dir, root / "bases" / "narrow-32")
    qv = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    build_adapter(narrow, root / "bad" / "hidden-32", seed=300, **qv)
    shapes = build_adapter(narrow, root / "bad" / "hidden-32-no-hint", seed=301, **qv)
    _forget_base_path(shapes)
    build_adapter(base_dir, root / "bad" / "rank128", seed=302, r=128, lora_alpha=128, target_modules=["q_proj"])
    # Broken directories: a config without weights, and a directory that is no adapter at all.
    no_weights = build_adapter(base_dir, root / "bad" / "no-weights", seed=303, **ADAPTER_KINDS["rank8"])
    (no_weights / "adapter_model.safetensors").unlink()
    (root / "bad" / "empty").mkdir()

    outside = build_adapter(base_dir, tmp / "outside" / "evil", seed=400, **ADAPTER_KINDS["rank8"])
    (root / "alias").symlink_to(root / "kinds" / "rank8", target_is_directory=True)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    return AdapterSet(base_dir=base_dir, root=root, outside=outside)


_SETS: dict[str, AdapterSet] = {}


def adapter_set(tmp_path_factory) -> AdapterSet:
    """The session's base model and adapter root, built on first use (tests of several modules
    share it; each module runs its own stack on it)."""
    if "set" not in _SETS:
        _SETS["set"] = _build(tmp_path_factory.mktemp("adapters"))
    return _SETS["set"]


def start_stack(adapters: AdapterSet, log_dir: Path, name: str, max_active_adapters: int | None = None,
                extra_args: list[str] | None = None) -> Stack:
    """The real launcher serving the base with local adapters from the set's root."""
    return start_adapter_stack(adapters.base_dir, adapters.root, log_dir, name, max_active_adapters, extra_args)


def start_adapter_stack(base_dir: Path, root: Path, log_dir: Path, name: str, max_active_adapters: int | None = None,
                        extra_args: list[str] | None = None) -> Stack:
    """The real launcher serving the base in `base_dir` with local adapters from `root`."""
    args = ["--adapter-source", "local", "--adapter-root", str(root), "--max-lora-rank", "64"]
    if max_active_adapters is not None:
        args += ["--max-active-adapters", str(max_active_adapters)]
    config = StackConfig(
        model_id=str(base_dir),
        served_model_name=SERVED_NAME,
        max_input_tokens=256,
        max_total_tokens=512,
        extra_args=args + (extra_args or []),
        extra_env=SHARD_ENV,
    )
    return Stack(config, log_dir / f"{name}.log").start()


# ---- the reference ------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def peft_model(base_dir: str, adapter_dir: str | None) -> Any:
    """The base from disk, with the adapter from disk on top (None: the bare base).

    Typed Any: a PeftModel passes `generate` on to the base through `__getattr__`, which its
    types do not show."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


@lru_cache(maxsize=256)
def _greedy(base_dir: str, adapter_dir: str | None, prompt_ids: tuple[int, ...], max_new_tokens: int,
            stop_at_eos: bool) -> reference.Greedy:
    model = peft_model(base_dir, adapter_dir)
    config = reference.load_model(base_dir).generation_config
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            # The server stops on the base's EOS too (unless the request sets ignore_eos).
            eos_token_id=config.eos_token_id if stop_at_eos else None,
            pad_token_id=config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(prompt_ids):].tolist()
    return reference.Greedy(token_ids=new, logits=[step[0] for step in out.logits[: len(new)]])


def greedy_with(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int,
                stop_at_eos: bool = True) -> reference.Greedy:
    """peft's greedy continuation for the base in `base_dir` with the adapter in `adapter_dir`
    (None: the bare base)."""
    adapter = None if adapter_dir is None else str(adapter_dir.resolve())
    return _greedy(str(base_dir.resolve()), adapter, tuple(prompt_ids), max_new_tokens, stop_at_eos)


def peft_greedy(adapters: AdapterSet, adapter_id: str | None, prompt_ids: list[int],
                max_new_tokens: int = MAX_TOKENS, stop_at_eos: bool = True) -> reference.Greedy:
    """peft's greedy continuation for a local adapter id (None: the base model)."""
    adapter_dir = None if adapter_id is None else str(adapters.adapter_dir(adapter_id).resolve())
    return _greedy(str(adapters.base_dir), adapter_dir, tuple(prompt_ids), max_new_tokens, stop_at_eos)


def greedy_completion_burst(stack: Stack, jobs: list[tuple[str | None, str]], max_tokens: int) -> list[Any]:
    """One concurrent burst of greedy completions with their token ids, a (model, prompt) pair
    each (model None: the served base), answered in the jobs' order."""
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def burst() -> list[Any]:
        return await asyncio.gather(*(
            client.completions.create(model=model or SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, extra_body=RETURN_TOKEN_IDS)
            for model, prompt in jobs))

    return asyncio.run(burst())


def completion_ids(adapters: AdapterSet, prompt: str) -> list[int]:
    return reference.completion_prompt_ids(str(adapters.base_dir), prompt)


def chat_ids(adapters: AdapterSet, messages: list[dict], chat_template: str | None = None,
             tokenizer_dir: Path | None = None) -> list[int]:
    """transformers' apply_chat_template, with the base's tokenizer (or `tokenizer_dir`'s) and its
    template (or `chat_template`)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or adapters.base_dir)
    encoded = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                            add_generation_prompt=True, tokenize=True)
    # One conversation, tokenized: a flat list of ids (in a BatchEncoding when it returns a dict).
    return list(cast(list[int], encoded["input_ids"] if isinstance(encoded, BatchEncoding) else encoded))


class PeakRunning:
    """The highest value a gauge of /metrics took (by default `quiver_requests_running`: shows
    that concurrent requests really shared batches), polled from a thread for the duration of a
    `with` block."""

    def __init__(self, stack: Stack, series: str = "quiver_requests_running"):
        self.stack = stack
        self.series = series
        self.value = 0.0
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                value = self.stack.metrics().get(self.series, 0.0)
            except (OSError, StackError):  # a slow scrape on a busy box: try again
                continue
            self.value = max(self.value, value)
            self.samples += 1

    def __enter__(self) -> PeakRunning:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=30)
