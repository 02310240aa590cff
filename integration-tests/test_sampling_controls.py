"""Sampling controls through the whole stack, held against transformers' raw logits: `logit_bias`,
`presence_penalty` / `frequency_penalty` (OpenAI's definition), `stop_token_ids`, and `seed`
with all of them inside a mixed batch.

OpenAI's penalties, over the tokens generated so far (not the prompt):
    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
and `logit_bias[t]` is added to logit[t]. With temperature 0 the chosen token is the argmax of
the result, so each served token is checked against transformers' logits on prompt + the served
prefix, adjusted here."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

import reference
from served import token_ids

PROMPTS = ["Hello", "The quick brown fox", "Once upon a time there was"]
MAX_TOKENS = 12
# ignore_eos: every choice runs to max_tokens, so each check covers MAX_TOKENS positions.
IDS = {"return_token_ids": True, "ignore_eos": True}


def _complete(client, model: str, prompt: str, **params):
    extra = {**IDS, **params.pop("extra_body", {})}
    params.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, max_tokens=params.pop("max_tokens", MAX_TOKENS),
                                     extra_body=extra, **params)


def _plain_token(model_dir: str, rank: int = 0) -> int:
    """An ordinary (non-special) token id of the test tokenizer: the rank-th such from 100 up."""
    specials = set(reference.load_tokenizer(model_dir).all_special_ids)
    return [t for t in range(100, 400) if t not in specials][rank]


def _step_logits(model_dir: str, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' raw logits that chose each generated token: row i scores position i."""
    model = reference.load_model(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids + generated]))
    start = len(prompt_ids) - 1
    return out.logits[0, start:start + len(generated)].float()


def _assert_openai_adjusted_argmax(model_dir: str, prompt_ids: list[int], served: list[int], presence: float,
                                   frequency: float, bias: dict[int, float], context: str) -> None:
    """Each served token is the argmax of raw logits + bias − OpenAI's penalties over the tokens
    before it; a near-tie (DESIGN.md's tolerance) excuses the first divergence, after which the
    continuations legitimately differ."""
    logits = _step_logits(model_dir, prompt_ids, served)
    for pos, got in enumerate(served):
        adjusted = logits[pos].clone()
        for token, value in bias.items():
            adjusted[token] += value
        for token, count in Counter(served[:pos]).items():
            adjusted[token] -= frequency * count + presence
        want = int(torch.argmax(adjusted))
        if got != want:
            gap = reference.top_two_gap(adjusted)
            assert gap <= reference.TIE_TOLERANCE, (
                f"{context}: token {pos} is {got}, OpenAI's penalties give {want} (gap {gap:.3g}); "
                f"served={served}")
            return


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logit_bias_plus_100_makes_every_token_that_token(client, llama, temperature):
    forced = _plain_token(str(llama.model_dir))
    for prompt in PROMPTS:
        response = _complete(client, llama.model, prompt, temperature=temperature, seed=7,
                             logit_bias={str(forced): 100})
        ids = token_ids(response)
        assert ids == [forced] * MAX_TOKENS, f"{prompt!r} (temperature {temperature}): {ids}"
        assert response.choices[0].finish_reason == "length"
        want = reference.load_tokenizer(str(llama.model_dir)).decode(ids, skip_special_tokens=True)
        assert response.choices[0].text == want


def test_logit_bias_plus_100_on_chat(client, llama):
    forced = _plain_token(str(llama.model_dir), rank=3)
    response = client.chat.completions.create(
        model=llama.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        logit_bias={str(forced): 100}, extra_body=IDS)
    assert token_ids(response) == [forced] * 6


def test_logit_bias_minus_100_removes_the_greedy_token(client, llama):
    model_dir = str(llama.model_dir)
    for prompt in PROMPTS:
        prompt_ids = reference.completion_prompt_ids(model_dir, prompt)
        greedy = reference.greedy(model_dir, prompt_ids, MAX_TOKENS, stop_at_eos=False).token_ids
        banned = greedy[0]
        ids = token_ids(_complete(client, llama.model, prompt, logit_bias={str(banned): -100}))
        assert banned not in ids, f"{prompt!r}: {banned} still generated: {ids}"
        _assert_openai_adjusted_argmax(model_dir, prompt_ids, ids, 0.0, 0.0, {banned: -100.0}, prompt)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.5), (0.7, -0.4), (-2.0, 2.0), (2.0, 2.0)])
def test_penalties_follow_openais_definition(client, llama, presence, frequency):
    model_dir = str(llama.model_dir)
    changed = False
    for prompt in PROMPTS:
        prompt_ids = reference.completion_prompt_ids(model_dir, prompt)
        plain = token_ids(_complete(client, llama.model, prompt))
        ids = token_ids(_complete(client, llama.model, prompt, presence_penalty=presence,
                                  frequency_penalty=frequency))
        assert len(ids) == MAX_TOKENS
        _assert_openai_adjusted_argmax(model_dir, prompt_ids, ids, presence, frequency, {},
                                       f"{prompt!r} presence {presence} frequency {frequency}")
        changed |= ids != plain
    # Tiny random models repeat themselves, so penalties this large must change some output;
    # otherwise the check above would pass with the penalties ignored.
    assert changed, "penalties changed no output: are they ignored?"


def test_penalties_and_bias_together(client, llama):
    model_dir = str(llama.model_dir)
    prompt = PROMPTS[1]
    prompt_ids = reference.completion_prompt_ids(model_dir, prompt)
    bias = {_plain_token(model_dir, 1): 4.0, _plain_token(model_dir, 2): 2.5}
    ids = token_ids(_complete(client, llama.model, prompt, presence_penalty=0.8, frequency_penalty=0.6,
                              logit_bias={str(t): v for t, v in bias.items()}))
    _assert_openai_adjusted_argmax(model_dir, prompt_ids, ids, 0.8, 0.6, bias, "penalties + bias")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_with_stop_and_are_not_shown(client, llama, stream):
    model_dir = str(llama.model_dir)
    prompt = PROMPTS[2]
    prompt_ids = reference.completion_prompt_ids(model_dir, prompt)
    ref = reference.greedy(model_dir, prompt_ids, MAX_TOKENS, stop_at_eos=False)
    greedy = ref.token_ids
    stop = greedy[3]
    end = greedy.index(stop)
    # ignore_eos (in IDS) ignores EOS only: a stop token the client named still ends the choice.
    params = dict(model=llama.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={**IDS, "stop_token_ids": [stop]})
    want_text = reference.load_tokenizer(model_dir).decode(greedy[:end], skip_special_tokens=True)
    if stream:
        text, reasons = "", []
        for chunk in client.completions.create(stream=True, **params):
            for choice in chunk.choices:
                text += choice.text
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        assert (text, reasons) == (want_text, ["stop"])
        return
    response = client.completions.create(**params)
    reference.assert_greedy_parity(token_ids(response), reference.Greedy(greedy[:end + 1], ref.logits[:end + 1]),
                                   "stop_token_ids")
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == want_text


def _seeded_request(model_dir: str) -> dict:
    bias = {str(_plain_token(model_dir, 1)): 3.0, str(_plain_token(model_dir, 4)): -2.0}
    return dict(prompt=PROMPTS[0], temperature=1.0, top_p=0.95, seed=1234, presence_penalty=0.6,
                frequency_penalty=0.4, logit_bias=bias, max_tokens=16, extra_body=IDS)


async def _mixed_batch(served, request: dict) -> list[int]:
    """The request once more, inside 12 others of every kind; returns its ids."""
    async with served.async_client() as client:
        others = []
        for i in range(12):
            params = dict(model=served.model, max_tokens=8 + i, extra_body=IDS)
            if i % 3 == 0:
                params.update(temperature=0.8, seed=i, presence_penalty=-1.0 + i / 10)
            elif i % 3 == 1:
                params.update(temperature=0, frequency_penalty=1.0, logit_bias={"150": 5})
            else:
                params.update(temperature=1.2, top_p=0.8, seed=100 + i)
            if i % 2:
                others.append(client.completions.create(prompt=PROMPTS[i % 3] * (1 + i % 4), **params))
            else:
                others.append(client.chat.completions.create(
                    messages=[{"role": "user", "content": PROMPTS[i % 3]}], **params))
        target = client.completions.create(model=served.model, **request)
        results = await asyncio.gather(target, *others)
    return token_ids(results[0])


def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(client, llama):
    request = _seeded_request(str(llama.model_dir))
    alone = token_ids(client.completions.create(model=llama.model, **request))
    again = token_ids(client.completions.create(model=llama.model, **request))
    assert again == alone
    for _ in range(2):
        assert asyncio.run(_mixed_batch(llama, request)) == alone
    other_seed = token_ids(client.completions.create(model=llama.model, **{**request, "seed": 99}))
    assert other_seed != alone, "a different seed gave the same tokens: is sampling seeded at all?"
