"""lm-evaluation-harness pointed at a running stack, offline, and the transformers computation its
log-likelihoods are held against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import reference

# The multiple-choice task the log-likelihood test runs (see its README).
TASK_DIR = Path(__file__).resolve().parent.parent / "testdata" / "lm-eval"
TASK = "quiver_colors"

# lm-eval reads its tasks' data through `datasets` and its tokenizer through `transformers`: with
# these set, neither tries a hub, so a test that needed the network fails instead of hanging.
OFFLINE_ENV = {
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
}

# One try: a refused request must fail the test with the server's answer, not be retried.
_NO_RETRIES = {"max_retries": 1}


def completions_model(served: Any, **extra: Any) -> Any:
    """lm-eval's `local-completions` model with the served model's own tokenizer."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=served.stack.base_url + "/v1/completions",
        model=served.model,
        tokenizer_backend="huggingface",
        tokenizer=str(served.model_dir),
        **_NO_RETRIES,
        **extra,
    )


def chat_model(served: Any) -> Any:
    """lm-eval's `local-chat-completions` model: the server renders the chat template."""
    from lm_eval.models.openai_completions import LocalChatCompletion

    return LocalChatCompletion(
        base_url=served.stack.base_url + "/v1/chat/completions", model=served.model, **_NO_RETRIES
    )


def generate_request(context: Any, until: list[str], max_gen_toks: int) -> Any:
    from lm_eval.api.instance import Instance

    return Instance(
        request_type="generate_until",
        doc={},
        arguments=(context, {"until": until, "max_gen_toks": max_gen_toks}),
        idx=0,
    )


def continuation_logprob(model_dir: str, context: str, continuation: str) -> float:
    """log P(continuation | context) from transformers, tokenized as a harness does: the
    continuation's tokens are what tokenizing context + continuation adds after the context's
    tokens (no BOS, as lm-eval's API models send by default)."""
    tokenizer = reference.load_tokenizer(model_dir)
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole_ids = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    assert whole_ids[: len(context_ids)] == context_ids, "the context's tokens change with the continuation"
    with torch.no_grad():
        logits = reference.load_model(model_dir)(torch.tensor([whole_ids])).logits[0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    positions = range(len(context_ids), len(whole_ids))
    return float(sum(logprobs[p - 1, whole_ids[p]] for p in positions))


def reference_text(model_dir: str, prompt_ids: list[int], max_tokens: int, until: list[str]) -> str:
    """transformers' greedy continuation of `prompt_ids`, cut before the first stop string."""
    greedy = reference.greedy(model_dir, prompt_ids, max_tokens)
    text = reference.load_tokenizer(model_dir).decode(greedy.token_ids, skip_special_tokens=True)
    for stop in until:
        text = text.split(stop, 1)[0]
    return text
