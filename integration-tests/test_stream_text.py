"""What a stream may carry, checked on a model whose output is known in advance (the "parrot"
of model_builders says PARROT_TEXT, whose characters span several byte-level tokens): no chunk
holds half a UTF-8 character, and no part of a stop string is ever sent."""

from __future__ import annotations

import pytest

from model_builders import PARROT_TEXT

PROMPT = "Repeat after me\n"  # the parrot speaks after a newline
MESSAGES = [{"role": "user", "content": "Repeat after me"}]


@pytest.fixture(scope="module")
def parrot(pool):
    return pool.get("parrot")


def _completion_stream(client, model: str, **kwargs) -> tuple[list[str], str | None]:
    texts, reason = [], None
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=40, stream=True, **kwargs):
        for choice in chunk.choices:
            texts.append(choice.text)
            reason = choice.finish_reason or reason
    return texts, reason


def _chat_stream(client, model: str, **kwargs) -> tuple[list[str], str | None]:
    texts, reason = [], None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, stream=True,
                                                **kwargs):
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return texts, reason


@pytest.mark.parametrize("stream", [_completion_stream, _chat_stream], ids=["completions", "chat"])
def test_no_chunk_carries_half_a_character(parrot, stream):
    with parrot.client() as client:
        texts, reason = stream(client, parrot.model)
    assert "".join(texts) == PARROT_TEXT
    # Half a character would have reached the JSON as U+FFFD (or broken the UTF-8 of the body).
    assert all("\ufffd" not in t for t in texts), texts
    assert reason == "stop", "the parrot ends with EOS"


@pytest.mark.parametrize(
    "stop",
    [["🙂"], ["京🙂K"], ["ö"], ["✨"], ["ln", "京"], ["Köx"], ["東京🙂Köln✨!"]],
    ids=["emoji", "spanning", "umlaut", "last", "earliest-wins", "prefix-only", "longer-than-output"],
)
@pytest.mark.parametrize("stream", [_completion_stream, _chat_stream], ids=["completions", "chat"])
def test_stop_strings_are_never_emitted_even_in_part(parrot, stream, stop):
    """A stop string ends the output just before its first occurrence; text that might begin a
    stop string is held back until it is known not to ("Kö" of "Köx" comes out at the end)."""
    matches = [PARROT_TEXT.index(s) for s in stop if s in PARROT_TEXT]
    expected = PARROT_TEXT[: min(matches)] if matches else PARROT_TEXT
    with parrot.client() as client:
        response = client.completions.create(model=parrot.model, prompt=PROMPT, max_tokens=40, stop=stop)
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason == "stop"
        texts, reason = stream(client, parrot.model, stop=stop)
    assert "".join(texts) == expected, texts
    assert reason == "stop"
