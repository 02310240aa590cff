"""Hypothesis strategies for request bodies of /v1/chat/completions and /v1/completions: every
field either a value the API accepts or one it must refuse, so that a body is sometimes valid,
mostly invalid in one or several ways, and never costly to serve (a valid one asks for at most
MAX_NEW_TOKENS tokens per choice and few choices)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from conftest import MAX_TOTAL_TOKENS
from reliability_checks import CHAT_PATH, COMPLETIONS_PATH

MAX_NEW_TOKENS = 8
# Any JSON value, kept small: the stand-in for "the wrong type" in every field.
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
# Numbers at the edges of the types a server parses into (u32, i64, u64, f32).
EDGE_NUMBERS = st.sampled_from([
    -1, 0, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, -0.0, 1e-300, 3.5e38, 1e308,
])
# Strings a careless server chokes on: control characters, bidi overrides, non-characters.
NASTY_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\u202e", "\ufeff", "\uffff", "NaN", "-Infinity", "{{ 7*7 }}", "<|im_end|>"]),
)


def _either(valid: st.SearchStrategy[Any], *others: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Half the time `valid`, else a value of another kind (an edge number, any JSON value, nasty
    text, or one of `others`): mostly the wrong type or out of range, sometimes valid by chance."""
    return st.one_of(valid, st.one_of(EDGE_NUMBERS, JSON_VALUES, NASTY_TEXT, *others))


def _cheap(strategy: st.SearchStrategy[Any], most: int) -> st.SearchStrategy[Any]:
    """Drops the values that would be valid and costly: numbers above `most` that the server
    accepts (it refuses 0, fractions and anything past its limits), and null, which means
    "absent" (an absent max_tokens asks for the whole context)."""

    def cheap(value: Any) -> bool:
        if value is None:
            return False
        return not (isinstance(value, int) and not isinstance(value, bool) and most < value <= MAX_TOTAL_TOKENS)

    return strategy.filter(cheap)


def _max_tokens() -> st.SearchStrategy[Any]:
    return _cheap(_either(st.integers(1, MAX_NEW_TOKENS)), MAX_NEW_TOKENS)


def _common(model: str) -> dict[str, st.SearchStrategy[Any]]:
    """Optional fields both endpoints share (and the extensions), each valid or not."""
    return {
        "model": _either(st.sampled_from([model, model, "", "no-such-model", "owner/name", "../up", "/abs"])),
        "temperature": _either(st.floats(0, 2)),
        "top_p": _either(st.floats(0, 1, exclude_min=True)),
        "n": _cheap(_either(st.integers(1, 3)), 3),
        "seed": _either(st.integers(-(2**63), 2**64 - 1)),
        "stop": _either(NASTY_TEXT, st.lists(NASTY_TEXT, max_size=5)),
        "stream": _either(st.booleans()),
        "stream_options": _either(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "top_k": _either(st.integers(-1, 50)),
        "min_p": _either(st.floats(0, 1)),
        "repetition_penalty": _either(st.floats(0.5, 2)),
        "ignore_eos": _either(st.booleans()),
        "min_tokens": _either(st.integers(0, MAX_NEW_TOKENS)),
        "return_token_ids": _either(st.booleans()),
        "logprobs": JSON_VALUES,
        "user": JSON_VALUES,
        "logit_bias": JSON_VALUES,
        "vendor_extension": JSON_VALUES,  # unknown fields are accepted without effect, named in a header
    }


def _message() -> st.SearchStrategy[Any]:
    roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])
    parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": NASTY_TEXT}),
                     max_size=2)
    return _either(st.fixed_dictionaries(
        {"role": _either(roles), "content": _either(NASTY_TEXT, parts)},
        optional={"name": _either(st.text(max_size=8))},
    ))


def chat_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    required = {
        "messages": _either(st.lists(_message(), max_size=4)),
        "max_tokens": _max_tokens(),
    }
    optional = {**_common(model), "max_completion_tokens": _max_tokens(),
                "tools": JSON_VALUES, "tool_choice": JSON_VALUES, "response_format": JSON_VALUES}
    return st.fixed_dictionaries(required, optional=optional)


def completion_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    token_ids = st.lists(st.integers(-2, 600), max_size=8)
    prompts = st.one_of(NASTY_TEXT, st.lists(NASTY_TEXT, max_size=3), token_ids, st.lists(token_ids, max_size=2))
    required = {"prompt": _either(prompts), "max_tokens": _max_tokens()}
    optional = {**_common(model), "echo": _either(st.just(False)), "suffix": _either(st.none())}
    return st.fixed_dictionaries(required, optional=optional)


def requests(model: str) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(path, body) for either endpoint."""
    return st.one_of(
        chat_bodies(model).map(lambda body: (CHAT_PATH, body)),
        completion_bodies(model).map(lambda body: (COMPLETIONS_PATH, body)),
    )
