"""Writes request-fields.json: the top-level field names of OpenAI's chat, legacy completions,
Responses and embeddings request bodies, read from ../openai-openapi/openapi.yaml (schemas
CreateChatCompletionRequest, CreateCompletionRequest, CreateResponse and CreateEmbeddingRequest,
following `$ref` and `allOf` as the spec composes them).

Run from the repository root after updating the spec:
    python testdata/openai/extract_request_fields.py
"""

import json
from pathlib import Path

import yaml

HERE = Path(__file__).parent
SCHEMAS = {
    "chat": "CreateChatCompletionRequest",
    "completions": "CreateCompletionRequest",
    "responses": "CreateResponse",
    "embeddings": "CreateEmbeddingRequest",
}


def properties(schemas: dict, schema: dict) -> set[str]:
    """The property names of `schema`, with those of every schema it references or composes."""
    if "$ref" in schema:
        return properties(schemas, schemas[schema["$ref"].rsplit("/", 1)[-1]])
    names = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        names |= properties(schemas, part)
    return names


def main() -> None:
    spec = yaml.safe_load((HERE.parent / "openai-openapi" / "openapi.yaml").read_text())
    schemas = spec["components"]["schemas"]
    fields = {
        endpoint: sorted(properties(schemas, schemas[name]))
        for endpoint, name in SCHEMAS.items()
    }
    (HERE / "request-fields.json").write_text(json.dumps(fields, indent=2) + "\n")


if __name__ == "__main__":
    main()
