"""What OpenAI documents for `logprobs`, checked on the JSON a client received (plain dicts, as
the raw body, an SDK object's `to_dict()`, langchain's metadata or the Node script's output give
them). Greedy requests only: there the sampled token is the most likely one."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import reference

# The chosen token's logprob and the best top_logprobs entry are one number sent twice; only
# float formatting may separate them.
SAME_NUMBER = 1e-6
REPLACEMENT = "\ufffd"


def _check_token_bytes(entry: dict[str, Any]) -> bytes:
    raw = bytes(entry["bytes"])
    try:
        assert entry["token"] == raw.decode("utf-8"), f"token {entry['token']!r} is not its bytes {raw!r}"
    except UnicodeDecodeError:
        pass  # a token that splits a UTF-8 character: `token` cannot spell it, `bytes` does
    return raw


@lru_cache(maxsize=8)
def special_tokens(model_dir: str) -> frozenset[str]:
    """Tokens that are generated (and so have logprobs) but are not text (EOS)."""
    return frozenset(reference.load_tokenizer(model_dir).all_special_tokens)


def check_chat_logprobs(content: list[dict[str, Any]], top_logprobs: int, text: str, model_dir: str) -> None:
    """`choices[].logprobs.content` of a greedy chat completion (or all of a stream's, joined):
    the bytes of its tokens, special tokens left out, spell `text`, bytes that are no UTF-8
    shown as U+FFFD."""
    assert content, "logprobs were asked for but the choice has none"
    joined = b""
    for entry in content:
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0.0, entry
        token_bytes = _check_token_bytes(entry)
        if entry["token"] not in special_tokens(model_dir):
            joined += token_bytes
        tops = entry["top_logprobs"]
        assert len(tops) == top_logprobs, f"{len(tops)} top_logprobs, asked for {top_logprobs}: {entry}"
        values = [top["logprob"] for top in tops]
        assert values == sorted(values, reverse=True), f"top_logprobs not most likely first: {entry}"
        for top in tops:
            _check_token_bytes(top)
        if tops:
            assert tops[0]["token"] == entry["token"], f"greedy chose {entry['token']!r}, not the top one: {entry}"
            assert abs(tops[0]["logprob"] - entry["logprob"]) <= SAME_NUMBER, entry
    spelled = joined.decode("utf-8", errors="replace")
    assert spelled == text, f"the tokens' bytes spell {spelled!r} ({joined!r}), the content is {text!r}"


def check_completion_logprobs(
    logprobs: dict[str, Any], top: int, text: str, echoed_prompt: str | None = None, prompt_tokens: int = 0
) -> None:
    """`choices[].logprobs` of a greedy completion. With `echoed_prompt` the choice is an `echo`
    whose first `prompt_tokens` tokens are the prompt's: its text starts with the prompt and the
    first token, which nothing precedes, has no logprob."""
    tokens = logprobs["tokens"]
    token_logprobs = logprobs["token_logprobs"]
    top_logprobs = logprobs["top_logprobs"]
    offsets = logprobs["text_offset"]
    assert tokens and len(tokens) == len(token_logprobs) == len(top_logprobs) == len(offsets), logprobs
    assert offsets == sorted(offsets), f"text_offset goes backwards: {offsets}"
    assert all(0 <= offset <= len(text) for offset in offsets), f"text_offset outside the text: {offsets}"
    first = 0
    if echoed_prompt is not None:
        assert text.startswith(echoed_prompt), f"echo: {text!r} does not start with the prompt {echoed_prompt!r}"
        assert token_logprobs[0] is None and top_logprobs[0] is None, "echo: the first token has no logprob"
        assert offsets[0] == 0
        first = 1
    entries = zip(tokens, token_logprobs, top_logprobs, strict=True)
    for position, (token, logprob, tops) in enumerate(entries):
        if position < first:
            continue
        assert isinstance(token, str)
        assert logprob is not None and math.isfinite(logprob) and logprob <= 0.0, logprobs
        # OpenAI (CreateCompletionRequest.logprobs): the `logprobs` most likely tokens "as well
        # the chosen tokens ... so there may be up to logprobs+1 elements"; with `echo` the
        # prompt's tokens are the chosen ones (vLLM lists them too). Tokens that are part of a
        # UTF-8 character all read U+FFFD, so they share one key.
        assert 1 <= len(tops) <= top + 1, f"{len(tops)} top_logprobs, asked for {top}: {tops}"
        assert token in tops, f"{token!r} is not among its own top_logprobs {tops}"
        if REPLACEMENT in token:
            continue
        assert abs(tops[token] - logprob) <= SAME_NUMBER, f"{token!r} {logprob} {tops}"
        if position >= prompt_tokens:
            assert logprob >= max(tops.values()) - SAME_NUMBER, f"greedy token {token!r} is not its top one: {tops}"
