"""lm-evaluation-harness (pinned in pyproject's `test` extra) as its users run it against an
OpenAI-compatible server: `local-completions` with the model's own tokenizer for a multiple-choice
task (log-likelihoods through `echo` + `logprobs`) and for generation, and `local-chat-completions`
for chat generation. Nothing is downloaded: the task and its data ship in testdata/lm-eval."""

from __future__ import annotations

import json

import pytest

from lm_eval_client import (
    OFFLINE_ENV,
    TASK,
    TASK_DIR,
    chat_model,
    completions_model,
    continuation_logprob,
    generate_request,
    reference_text,
)
import reference

# Logprobs equal transformers' log_softmax on the same weights within this (the project's bar for logprobs).
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)


def test_multiple_choice_loglikelihoods_equal_transformers(llama):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=completions_model(llama),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
    )
    assert results is not None
    samples = results["samples"][TASK]
    questions = json.loads((TASK_DIR / TASK / "questions.json").read_text(encoding="utf-8"))
    assert len(samples) == len(questions)
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
    model_dir = str(llama.model_dir)
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), (loglikelihood, _is_greedy) in zip(
            sample["arguments"], sample["filtered_resps"], strict=True
        ):
            want = continuation_logprob(model_dir, context, continuation)
            assert abs(loglikelihood - want) <= LOGPROB_TOLERANCE, (
                f"log P({continuation!r} | {context!r}): lm-eval got {loglikelihood}, transformers {want}"
            )


def test_completions_generate_until_equals_transformers(llama):
    lm = completions_model(llama)
    context = "The weather today is"
    until = ["\n\n", "."]
    [text] = lm.generate_until([generate_request(context, until, max_gen_toks=12)])
    model_dir = str(llama.model_dir)
    prompt_ids = reference.load_tokenizer(model_dir)(context, add_special_tokens=False)["input_ids"]
    assert text == reference_text(model_dir, prompt_ids, 12, until)


def test_chat_completions_generate_until_equals_transformers(llama):
    from lm_eval.models.api_models import JsonChatStr

    lm = chat_model(llama)
    messages = [{"role": "user", "content": "Name a colour."}]
    [text] = lm.generate_until([generate_request(JsonChatStr(json.dumps(messages)), ["\n\n"], max_gen_toks=10)])
    model_dir = str(llama.model_dir)
    prompt_ids = reference.chat_prompt_ids(model_dir, messages)
    assert text == reference_text(model_dir, prompt_ids, 10, ["\n\n"])
