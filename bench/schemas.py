"""JSON schemas for the structured-output scenarios, sized to the run's output length.

On a random-weight model only the grammar shapes the output, and a greedy random model almost
never picks the one token that closes a string or an array while thousands of others are
allowed: strings run to their `maxLength`, arrays towards their `maxItems`. So a schema whose
every field is bounded and required has a predictable length, and `object_schema` adds fields
while its estimated length stays within 90% of the target (`--max-tokens`), so the constrained
streams generate about as many tokens as the free ones and the grammar completes
(`finish_reason: "stop"`) rather than running out.

Estimates are in tokens of bench/json_model.py's vocabulary: property names and enum values
are whole tokens there (KEYS, ENUM_VALUES), JSON punctuation comes in pieces (`{"`, `":"`,
`","`...), string content in words of about 6 characters (" w1234"), digits one by one.
Checked by sampling uniformly among the allowed tokens with llguidance (a random model's argmax
is such a draw), 24 outputs per target: mean 57 tokens for 64 (49-70), 15 for 16; in the first
bench run the constrained streams averaged 56.8 of 64.
"""

from __future__ import annotations

# Property names: whole tokens in the bench vocabulary, as common keys are in real tokenizers.
KEYS = ("name", "email", "city", "country", "status", "score", "count", "active", "tags", "notes",
        "title", "summary", "category", "priority", "owner", "region", "rating", "verified",
        "labels", "comment", "source", "level", "kind", "label")
ENUM_VALUES = ("low", "medium", "high", "urgent", "open", "closed", "pending", "active", "draft",
               "review", "done", "error")
STRING_MAX = 30  # characters: about 5 words of the bench vocabulary, the closing quote forced
TAG_MAX = 12
TAGS_MAX_ITEMS = 3
# Of the target the estimate aims at: sampled outputs came out about 1.15x the estimate.
BUDGET_SHARE = 0.9


def _string(max_length: int) -> tuple[dict, int]:
    # Words until fewer than a word's characters remain, then single characters, then the quote.
    return {"type": "string", "maxLength": max_length}, max_length // 6 + 4


def _field(kind: int, salt: int) -> tuple[dict, int]:
    """(schema, estimated tokens of the value) for field kind `kind` (cycled)."""
    kind %= 5
    if kind == 0:
        return _string(STRING_MAX)
    if kind == 1:
        values = [ENUM_VALUES[(salt + i) % len(ENUM_VALUES)] for i in range(3)]
        return {"enum": values}, 4
    if kind == 2:
        return {"type": "integer", "minimum": 0, "maximum": 999}, 4
    if kind == 3:
        return {"type": "boolean"}, 2
    item, item_tokens = _string(TAG_MAX)
    array = {"type": "array", "items": item, "minItems": 1, "maxItems": TAGS_MAX_ITEMS}
    return array, 2 + 2 * (item_tokens + 1)  # a random model closes an array about half the time


def object_schema(index: int, target_tokens: int, key_prefix: str = "") -> dict:
    """A schema of required, bounded fields whose output is about `target_tokens` long; `index`
    varies the field order, names and enums, so schemas of different indices differ (one per
    adapter). A `key_prefix` makes every property name new (the compile-stall requests): names
    are then spelled character by character, so fewer fields reach the target."""
    properties: dict[str, dict] = {}
    tokens = 2  # `{"` and `}`
    budget = target_tokens * BUDGET_SHARE
    for field in range(len(KEYS) * 4):
        key = KEYS[(index * 7 + field) % len(KEYS)]
        if key in properties or key_prefix:
            key = f"{key_prefix}{key}{field}"
        value, value_tokens = _field(index + field, index + field)
        # `,"` key `":`, a whole-token key often spelled in characters anyway (both are allowed)
        key_tokens = 5 if not key_prefix else 2 + len(key)
        if properties and tokens + key_tokens + value_tokens > budget:
            break
        properties[key] = value
        tokens += key_tokens + value_tokens
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
