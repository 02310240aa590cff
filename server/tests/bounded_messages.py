"""Reads a message that bounded_text cut: the kept head and the count its note gives."""

from __future__ import annotations

import re

NOTE = re.compile(r"… \(([\d,]+) more bytes\)$")


def cut_parts(message: str) -> tuple[str, int]:
    """(the kept head, the byte count the note gives) of a cut message."""
    note = NOTE.search(message)
    assert note is not None, f"no note of what was cut: {message[-80:]!r}"
    return message[: note.start()], int(note.group(1).replace(",", ""))
