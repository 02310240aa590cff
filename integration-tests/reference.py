"""The independent reference: transformers greedy decoding in float32 on CPU, and DESIGN.md's
correctness rule for comparing the served tokens with it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# DESIGN.md: a divergence is accepted only where the reference's top-two logits are this close.
TIE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Greedy:
    """Reference continuation: token ids (EOS included if reached) and the raw logits that chose
    each of them."""

    token_ids: list[int]
    logits: list[torch.Tensor]


@lru_cache(maxsize=8)
def load_model(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: str, messages: list[dict]) -> list[int]:
    encoded = load_tokenizer(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding, older releases a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def completion_prompt_ids(model_dir: str, prompt: str) -> list[int]:
    return list(load_tokenizer(model_dir)(prompt)["input_ids"])


def greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> Greedy:
    """`stop_at_eos=False` is the reference of a request with `ignore_eos`."""
    model = load_model(model_dir)
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=model.generation_config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[0, len(prompt_ids):].tolist()
    return Greedy(token_ids=new, logits=[step[0] for step in out.logits[: len(new)]])


def top_two_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_greedy_parity(served: list[int], reference: Greedy, context: str = "") -> None:
    """Served tokens must equal the reference token for token; the first divergence is excused
    only where the reference's top-two logits are within TIE_TOLERANCE (after it the two
    continuations legitimately differ, so comparison stops there)."""
    ref = reference.token_ids
    for pos, (got, want) in enumerate(zip(served, ref, strict=False)):
        if got == want:
            continue
        gap = top_two_gap(reference.logits[pos])
        assert gap <= TIE_TOLERANCE, (
            f"{context}: token {pos} differs: served {got}, reference {want} "
            f"(reference top-two gap {gap:.3g} > {TIE_TOLERANCE}); served={served} reference={ref}"
        )
        return
    assert len(served) == len(ref), (
        f"{context}: lengths differ with equal prefix: served {len(served)} tokens, reference "
        f"{len(ref)}; served={served} reference={ref}"
    )
