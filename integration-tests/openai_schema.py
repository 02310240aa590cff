"""Validates response bodies against OpenAI's published OpenAPI description.

The description ships in the repository (`testdata/openai-openapi/openapi.yaml`); its schemas
are JSON Schema 2020-12 except for the OpenAPI 3.0 keyword `nullable`, which is rewritten into a
union with null before validating.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

OPENAPI_PATH = Path(__file__).resolve().parent.parent / "testdata" / "openai-openapi" / "openapi.yaml"
_BASE_URI = "urn:openai-openapi"
# OpenAI has no schema for legacy-completion stream chunks; they are completion objects whose
# choices carry `finish_reason: null` until the last one (this is what the API sends).
COMPLETION_CHUNK = "CreateCompletionStreamChunk"
# OpenAI's API answers `echo` + `logprobs` with `null` as the first prompt token's logprob and
# top_logprobs (nothing precedes it), which its published schema does not allow: a completion
# response where those two arrays may hold nulls.
COMPLETION_ECHO = "CreateCompletionEchoResponse"


def _rewrite_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewrite_nullable(value) for key, value in node.items()}
    if node.pop("nullable", False) is not True:
        return node
    if "enum" in node and None not in node["enum"]:
        node["enum"] = [*node["enum"], None]
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        node["type"] = [*types, "null"] if "null" not in types else types
        return node
    return {"anyOf": [node, {"type": "null"}]}


def _completion_chunk_schema(schemas: dict) -> dict:
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["type"] = [reason["type"], "null"]
    reason["enum"] = [*reason["enum"], None]
    return chunk


def _completion_echo_schema(schemas: dict) -> dict:
    echo = copy.deepcopy(schemas["CreateCompletionResponse"])
    logprobs = echo["properties"]["choices"]["items"]["properties"]["logprobs"]
    [fields] = [branch["properties"] for branch in logprobs["anyOf"] if branch.get("type") == "object"]
    for name in ("token_logprobs", "top_logprobs"):
        fields[name]["items"] = {"anyOf": [fields[name]["items"], {"type": "null"}]}
    return echo


def _closed(document: dict) -> dict:
    """`document` with every object schema that lists its properties closed, so that a field
    OpenAI's schema does not have fails validation. `unevaluatedProperties: false` (JSON Schema
    2020-12) counts the properties an `allOf` brings in, so a composed schema is closed as a
    whole; the parts it is composed of (inline, or components only ever used in an `allOf`)
    stay open, since each lists only its share."""
    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    parts = {item["$ref"].rsplit("/", 1)[-1] for item in _all_of_items(document) if "$ref" in item}
    for name, schema in schemas.items():
        _close(schema, part=name in parts)
    return document


def _all_of_items(node: Any) -> list[dict]:
    if isinstance(node, list):
        return [item for child in node for item in _all_of_items(child)]
    if not isinstance(node, dict):
        return []
    found = [item for item in node.get("allOf", []) if isinstance(item, dict)]
    return found + [item for value in node.values() for item in _all_of_items(value)]


def _close(node: Any, part: bool = False) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key == "allOf":
            for item in value:
                _close(item, part=True)
        else:
            _close(value)
    lists_fields = "properties" in node or "allOf" in node
    if lists_fields and not part and "additionalProperties" not in node:
        node.setdefault("unevaluatedProperties", False)


@lru_cache(maxsize=2)
def _registry(closed: bool = False) -> tuple[Registry, dict]:
    if not OPENAPI_PATH.exists():
        raise FileNotFoundError(
            f"OpenAI's OpenAPI description is missing at {OPENAPI_PATH}: the integration tests "
            "validate responses against it (it ships in testdata/openai-openapi/)"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(OPENAPI_PATH, encoding="utf-8") as f:
        document = _rewrite_nullable(yaml.load(f, Loader=loader))
    if closed:
        document = _closed(document)
    schemas = document["components"]["schemas"]
    schemas[COMPLETION_CHUNK] = _completion_chunk_schema(schemas)
    schemas[COMPLETION_ECHO] = _completion_echo_schema(schemas)
    resource = Resource.from_contents(document, default_specification=DRAFT202012)
    return Registry().with_resource(_BASE_URI, resource), schemas


def validate(instance: Any, schema_name: str, closed: bool = False) -> None:
    """Raises jsonschema.ValidationError if `instance` does not match
    `#/components/schemas/<schema_name>`; `closed`: with no properties beyond the schema's."""
    registry, schemas = _registry(closed)
    if schema_name not in schemas:
        raise KeyError(f"no schema {schema_name} in {OPENAPI_PATH}")
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"{_BASE_URI}#/components/schemas/{schema_name}"}, registry=registry
    )
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        detail = "\n".join(f"  at {list(e.absolute_path)}: {e.message}" for e in errors[:10])
        raise jsonschema.ValidationError(f"{schema_name} violated by {instance!r}:\n{detail}")
