"""Reading what the server sent: vLLM's `return_token_ids` extension and raw JSON bodies."""

from __future__ import annotations

from typing import Any

# Ask for token ids (vLLM's extension): `prompt_token_ids` and per-choice `token_ids`.
RETURN_TOKEN_IDS = {"return_token_ids": True}


def _extra(obj: Any, name: str) -> Any:
    # The SDK keeps fields it does not know as extra attributes of its pydantic models.
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def token_ids(response: Any, index: int = 0) -> list[int]:
    choice = response.choices[index]
    ids = _extra(choice, "token_ids")
    assert ids is not None, f"choice {index} has no token_ids although return_token_ids was set"
    return list(ids)


def stream_token_ids(choice: Any) -> list[int]:
    """The ids a streamed chunk's choice carries (none on a chunk without text)."""
    return list(_extra(choice, "token_ids") or [])


def prompt_token_ids(response: Any, index: int = 0) -> list[int]:
    """The prompt's ids: per choice (vLLM's completions) or top-level (its chat)."""
    ids = _extra(response.choices[index], "prompt_token_ids")
    if ids is None:
        ids = _extra(response, "prompt_token_ids")
    assert ids is not None, "response has no prompt_token_ids although return_token_ids was set"
    return list(ids)


def raw_json(raw_response: Any) -> Any:
    """The body as the server sent it, from an SDK `with_raw_response` call."""
    return raw_response.http_response.json()
