"""Error text kept short enough to cross gRPC and reach a client.

A status message travels in the grpc-message trailer, and a trailer past about 16 KB makes the
router's h2 client drop the whole connection (too many CONTINUATION frames), for every request
on it. A message that echoes what a client or an adapter sent (a regex, a module list) can be
that long, so every message the shard answers with is cut to `MAX_MESSAGE_BYTES` with a note of
how much was cut, and messages name client or adapter values through `shown`/`listed`, which
shorten them.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any

MAX_MESSAGE_BYTES = 512  # UTF-8 bytes of a whole message, the note of what was cut included
MAX_VALUE_CHARS = 60  # characters of one echoed value
MAX_LISTED = 3  # values of a list echoed before the rest are counted


def _cut_note(cut_bytes: int) -> str:
    return f"… ({cut_bytes:,} more bytes)"


def bounded(text: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`text` in at most `limit` UTF-8 bytes, cut on a character boundary and ending with a note
    of how many bytes were cut. Characters UTF-8 cannot carry (lone surrogates) become '?'."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data.decode("utf-8")
    # The note for the largest possible cut is at least as long as the real one: room for it.
    room = max(0, limit - len(_cut_note(len(data)).encode()))
    head = data[:room].decode("utf-8", "ignore")  # drops a character split by the cut
    return head + _cut_note(len(data) - len(head.encode()))


def clipped(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`text` cut to `limit` characters, "…" marking a cut."""
    return text if len(text) <= limit else text[:limit] + "…"


# repr that stops early: a value may be a long list or deeply nested (a full repr could recurse
# past Python's limit while the error message is being made).
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = MAX_LISTED
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = MAX_VALUE_CHARS


def shown(value: Any) -> str:
    """A client's or an adapter's value as a message quotes it: its repr, shortened."""
    return clipped(_SHORT_REPR.repr(value))


def listed(values: Sequence[Any], limit: int = MAX_LISTED) -> str:
    """The first `limit` values `shown`, the rest counted: "'a', 'b', 'c' and 197 more"."""
    head = ", ".join(shown(value) for value in values[:limit])
    return head + (f" and {len(values) - limit} more" if len(values) > limit else "")
