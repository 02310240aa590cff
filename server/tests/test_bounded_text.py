"""bounded_text: a message cut to its byte bound on a character boundary, saying exactly how many
bytes were cut; echoed values shortened, however long or deep."""

from __future__ import annotations

import pytest
from bounded_messages import cut_parts

from quiver_server.bounded_text import MAX_MESSAGE_BYTES, bounded, listed, shown


@pytest.mark.parametrize("unit", ["a", "é", "€", "😀", "aé€😀"], ids=["1-byte", "2-byte", "3-byte", "4-byte", "mixed"])
@pytest.mark.parametrize("limit", [MAX_MESSAGE_BYTES, 100, 37])
def test_a_long_text_is_cut_on_a_character_to_the_bound(unit: str, limit: int) -> None:
    text = "refused: " + unit * 5000
    message = bounded(text, limit)
    assert len(message.encode()) <= limit
    head, cut = cut_parts(message)
    assert text.startswith(head) and len(head) > 0
    assert cut == len(text.encode()) - len(head.encode())  # the count is exact
    # Cut no shorter than it had to be (the note's room is that of the longest count).
    assert len(message.encode()) > limit - 8


def test_a_text_within_the_bound_is_unchanged() -> None:
    text = "€" * (MAX_MESSAGE_BYTES // 3)
    assert bounded(text) == text
    assert bounded("") == ""


def test_characters_utf8_cannot_carry_are_replaced() -> None:
    # A lone surrogate (JSON may hold one: "\ud800") cannot be encoded into a gRPC trailer.
    assert bounded("bad \ud800 name") == "bad ? name"
    assert len(bounded("\ud800" * 10_000).encode()) <= MAX_MESSAGE_BYTES


def test_values_are_shown_shortened() -> None:
    modules = [f"m{i:05d}" + "x" * 94 for i in range(200)]
    assert len(listed(modules)) < 250 and listed(modules).endswith(" and 197 more")
    assert listed(["q_proj", "c_attn"]) == "'q_proj', 'c_attn'"
    assert shown("all") == "'all'" and shown(["lm_head"]) == "['lm_head']"
    assert len(shown("x" * 100_000)) <= 61
    deep: list = []
    for _ in range(100_000):  # deeper than repr could recurse
        deep = [deep]
    assert len(shown(deep)) <= 61
