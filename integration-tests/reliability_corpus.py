"""The bad-input corpus (reliability_corpus.json) turned into the bytes each case sends."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reliability_checks import CHAT_PATH, COMPLETIONS_PATH

CORPUS_PATH = Path(__file__).resolve().parent / "reliability_corpus.json"
_PATHS = {"chat": [CHAT_PATH], "completions": [COMPLETIONS_PATH], "both": [CHAT_PATH, COMPLETIONS_PATH]}


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: bytes
    content_type: str | None
    # The one status the case must get, where the case pins it (else: any, never 5xx).
    expect_status: int | None = None


def minimal_body(path: str, model: str) -> dict[str, Any]:
    """The fewest fields that make a valid, short request on `path`."""
    if path == CHAT_PATH:
        return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    return {"model": model, "prompt": "Hello", "max_tokens": 4}


def _substitute(node: Any, model: str) -> Any:
    if node == "$MODEL":
        return model
    if isinstance(node, list):
        return [_substitute(item, model) for item in node]
    if isinstance(node, dict):
        return {key: _substitute(value, model) for key, value in node.items()}
    return node


def _with_field(base: dict[str, Any], field: str, raw_json_value: str) -> bytes:
    """`base` with `field` set to an already-serialised value (one json.dumps could not write)."""
    rest = {key: value for key, value in base.items() if key != field}
    head = json.dumps(rest)[:-1]
    return f"{head}, {json.dumps(field)}: {raw_json_value}}}".encode()


def _body(entry: dict[str, Any], path: str, model: str) -> bytes:
    base = minimal_body(path, model)
    if "raw" in entry:
        # Code points 0-255 are bytes: the way to write invalid UTF-8 in a JSON file.
        return entry["raw"].replace("$MODEL", model).encode("latin-1")
    if "nest" in entry:
        depth = entry["nest"]["depth"]
        return _with_field(base, entry["nest"]["field"], "[" * depth + "]" * depth)
    if "big" in entry:
        big = entry["big"]
        unit, count = big["unit"], big["count"]
        value = unit * count if isinstance(unit, str) else [unit] * count
        return json.dumps({**base, big["field"]: value}).encode()
    body = _substitute(entry["body"], model)
    if body.pop("$BASE", False):
        body = {**base, **body}
    return json.dumps(body).encode()


def load_cases(model: str) -> list[Case]:
    entries = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))["cases"]
    cases = []
    for entry in entries:
        for path in _PATHS[entry["endpoint"]]:
            endpoint = "chat" if path == CHAT_PATH else "completions"
            cases.append(Case(id=f"{endpoint}-{entry['name']}", path=path, body=_body(entry, path, model),
                              content_type=entry.get("content_type", "application/json"),
                              expect_status=entry.get("expect_status")))
    return cases
