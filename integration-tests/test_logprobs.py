"""Logprobs through the whole stack against transformers/peft in float32 on CPU: the served
logprobs are the raw `log_softmax` of the model's logits (vLLM's default), for generated tokens
(chat and completions, with their top-5), for the prompt (`echo` with `max_tokens: 0`, and vLLM's
`prompt_logprobs`), on the base and on an adapter, while other requests share the batch; and
`best_of` returns the candidate with the highest cumulative logprob.

The reference scores the served tokens by teacher forcing: one forward pass over prompt +
generated tokens, `log_softmax` per position. Responses are checked against OpenAI's schema."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import pytest
import torch

import openai_schema
from adapter_models import SERVED_NAME, adapter_set, chat_ids, completion_ids, peft_model, start_stack

TOLERANCE = 1e-4
ADAPTER = "kinds/rank8"
MODELS = [None, ADAPTER]
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Name a city."}]
MAX_TOKENS = 8
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return adapter_set(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    stack = start_stack(adapters, tmp_path_factory.mktemp("logs"), "logprobs")
    yield stack
    stack.stop()


@lru_cache(maxsize=64)
def _log_softmax(base_dir: str, adapter_dir: str | None, ids: tuple[int, ...]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
    model = peft_model(base_dir, adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def reference(adapters, model: str | None, ids: list[int]) -> torch.Tensor:
    adapter_dir = None if model is None else str(adapters.adapter_dir(model).resolve())
    return _log_softmax(str(adapters.base_dir), adapter_dir, tuple(ids))


def post(stack, path: str, body: dict) -> dict:
    status, response = stack.post_json(path, body, timeout=120)
    assert status == 200, f"{path} {body}: {status} {response}"
    return response


def assert_close(got: float, want: float, context: str) -> None:
    assert abs(got - want) <= TOLERANCE, f"{context}: served {got}, transformers {want}"


def assert_top(got: list[float], row: torch.Tensor, k: int, context: str) -> None:
    """The served alternatives' logprobs are the reference's k largest, most likely first."""
    want = torch.topk(row, k).values.tolist()
    assert len(got) == k, f"{context}: {len(got)} alternatives, wanted {k}"
    for rank, (g, w) in enumerate(zip(sorted(got, reverse=True), want, strict=True)):
        assert_close(g, w, f"{context}, alternative {rank}")


def completion_body(model: str | None, **extra) -> dict:
    return {
        "model": model or SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def chat_body(model: str | None, **extra) -> dict:
    return {
        "model": model or SERVED_NAME,
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }


def check_completion(adapters, model, response: dict) -> None:
    openai_schema.validate(response, "CreateCompletionResponse")
    choice = response["choices"][0]
    prompt = completion_ids(adapters, PROMPT)
    generated = choice["token_ids"]
    rows = reference(adapters, model, prompt + generated)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(generated)
    assert logprobs["text_offset"][0] == 0
    for i, token in enumerate(generated):
        row = rows[len(prompt) + i - 1]
        context = f"model {model}, completion token {i}"
        assert_close(logprobs["token_logprobs"][i], float(row[token]), context)
        # Alternatives keyed by their text: distinct tokens may share one (rare at top-5).
        top = list(logprobs["top_logprobs"][i].values())
        if len(top) == 5:
            assert_top(top, row, 5, context)


def check_chat(adapters, model, response: dict) -> None:
    openai_schema.validate(response, "CreateChatCompletionResponse")
    choice = response["choices"][0]
    prompt = chat_ids(adapters, CHAT)
    generated = choice["token_ids"]
    rows = reference(adapters, model, prompt + generated)
    content = choice["logprobs"]["content"]
    assert len(content) == len(generated)
    for i, (entry, token) in enumerate(zip(content, generated, strict=True)):
        row = rows[len(prompt) + i - 1]
        context = f"model {model}, chat token {i}"
        assert_close(entry["logprob"], float(row[token]), context)
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"], context
        assert_top([alt["logprob"] for alt in entry["top_logprobs"]], row, 5, context)


def test_generated_logprobs_equal_log_softmax_in_a_shared_batch(stack, adapters):
    """Base and adapter, chat and completions, sent together with plain requests (the batch is
    shared: the logprob rows must not mix)."""
    asked = [("completion", model) for model in MODELS] + [("chat", model) for model in MODELS]
    bodies = [
        completion_body(model, logprobs=5) if kind == "completion" else chat_body(model, logprobs=True, top_logprobs=5)
        for kind, model in asked
    ]
    paths = [COMPLETIONS if kind == "completion" else CHAT_COMPLETIONS for kind, _ in asked]
    noise = [
        (COMPLETIONS, completion_body(model, prompt=f"Count to {i}:", max_tokens=16))
        for i, model in enumerate(MODELS * 3)
    ]
    jobs = list(zip(paths, bodies, strict=True)) + noise
    with ThreadPoolExecutor(len(jobs)) as executor:
        responses = list(executor.map(lambda job: post(stack, *job), jobs))
    for (kind, model), response in zip(asked, responses, strict=False):
        if kind == "completion":
            check_completion(adapters, model, response)
        else:
            check_chat(adapters, model, response)


def test_streamed_logprobs_equal_the_whole_response(stack, adapters):
    import json
    import urllib.request

    body = completion_body(ADAPTER, logprobs=5)
    whole = post(stack, COMPLETIONS, body)["choices"][0]["logprobs"]
    request = urllib.request.Request(
        stack.base_url + COMPLETIONS,
        method="POST",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    joined: dict[str, list] = {field: [] for field in whole}
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            openai_schema.validate(chunk, openai_schema.COMPLETION_CHUNK)
            for choice in chunk["choices"]:
                for field, values in (choice.get("logprobs") or {}).items():
                    joined[field] += values
    assert joined["tokens"] == whole["tokens"]
    assert joined["text_offset"] == whole["text_offset"]
    for got, want in zip(joined["token_logprobs"], whole["token_logprobs"], strict=True):
        assert_close(got, want, "streamed vs whole")


@pytest.mark.parametrize("model", MODELS)
def test_echo_with_max_tokens_0_scores_the_prompt(stack, adapters, model):
    """lm-eval's log-likelihood request: the prompt's own logprobs, nothing generated."""
    response = post(stack, COMPLETIONS, completion_body(model, max_tokens=0, echo=True, logprobs=1))
    choice = response["choices"][0]
    prompt = completion_ids(adapters, PROMPT)
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 0
    rows = reference(adapters, model, prompt)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(prompt)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(prompt)):
        context = f"model {model}, prompt token {i}"
        assert_close(logprobs["token_logprobs"][i], float(rows[i - 1][prompt[i]]), context)
        # The alternative and the prompt token itself (OpenAI's "logprobs + 1"), keyed by text.
        top = logprobs["top_logprobs"][i]
        assert_close(top[logprobs["tokens"][i]], float(rows[i - 1][prompt[i]]), context)
        assert len(top) in (1, 2), context
        assert_top(sorted(top.values(), reverse=True)[:1], rows[i - 1], 1, context)


@pytest.mark.parametrize("model", MODELS)
def test_prompt_logprobs_equal_log_softmax(stack, adapters, model):
    k = 3
    response = post(stack, COMPLETIONS, completion_body(model, max_tokens=1, prompt_logprobs=k))
    positions = response["choices"][0]["prompt_logprobs"]
    prompt = completion_ids(adapters, PROMPT)
    rows = reference(adapters, model, prompt)
    assert len(positions) == len(prompt) and positions[0] is None
    for i in range(1, len(prompt)):
        row, token = rows[i - 1], prompt[i]
        entries = {int(key): value for key, value in positions[i].items()}
        context = f"model {model}, prompt position {i}"
        assert_close(entries[token]["logprob"], float(row[token]), context)
        assert entries[token]["rank"] == 1 + int((row > row[token]).sum()), context
        top = torch.topk(row, k)
        for rank, (value, alt) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            if alt in entries:  # a near tie may pick the other token
                assert_close(entries[alt]["logprob"], value, f"{context}, alternative {rank}")
        assert len(entries) in (k, k + 1), context

    chat = post(stack, CHAT_COMPLETIONS, chat_body(model, max_tokens=1, prompt_logprobs=0))
    chat_prompt = chat_ids(adapters, CHAT)
    rows = reference(adapters, model, chat_prompt)
    positions = chat["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(chat_prompt)
    for i in range(1, len(chat_prompt)):
        entry = positions[i][str(chat_prompt[i])]
        assert_close(entry["logprob"], float(rows[i - 1][chat_prompt[i]]), f"chat prompt position {i}")


def test_best_of_returns_the_most_likely_candidate(stack, adapters):
    """best_of=3 draws the same three candidates as n=3 with the same seed (choice c is seeded
    seed + c); the one returned has the highest cumulative logprob under transformers."""
    sampled = dict(temperature=1.0, seed=1234, max_tokens=6)
    candidates = post(stack, COMPLETIONS, completion_body(None, n=3, **sampled))["choices"]
    best = post(stack, COMPLETIONS, completion_body(None, n=1, best_of=3, **sampled))
    openai_schema.validate(best, "CreateCompletionResponse")
    prompt = completion_ids(adapters, PROMPT)

    def cumulative(ids: list[int]) -> float:
        rows = reference(adapters, None, prompt + ids)
        return sum(float(rows[len(prompt) + i - 1][t]) for i, t in enumerate(ids))

    scores = [cumulative(choice["token_ids"]) for choice in candidates]
    winner = candidates[max(range(3), key=lambda c: scores[c])]
    assert len(best["choices"]) == 1 and best["choices"][0]["index"] == 0
    assert best["choices"][0]["token_ids"] == winner["token_ids"], scores
    assert best["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in candidates)
