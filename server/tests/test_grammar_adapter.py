"""An adapter whose directory has its own tokenizer.json gets grammars built for that tokenizer:
here one whose ids map to other strings than the base's. Its constrained output decodes, with
its own tokenizer, to valid JSON; the base model's requests keep the base tokenizer's grammar,
in the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from block_tables import Blocks
from grammar_models import (
    build_grammar_model,
    generate,
    json_grammar,
    new_engine,
    permuted_tokenizer,
    request,
    text,
)
from tiny_adapters import build_adapter

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 31}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
PROMPT = [40, 41, 42, 43]


def test_an_adapter_with_its_own_tokenizer_gets_its_own_grammar(tmp_path: Path) -> None:
    base_dir, base_tokenizer = build_grammar_model(tmp_path / "base")
    adapter_dir = build_adapter(base_dir, tmp_path / "adapter", seed=1, r=8, target_modules=["q_proj", "v_proj"])
    own_tokenizer = permuted_tokenizer(base_tokenizer)
    own_tokenizer.save(str(adapter_dir / "tokenizer.json"))
    # And one without: it uses the base's tokenizer.
    plain_dir = build_adapter(base_dir, tmp_path / "plain", seed=2, r=8, target_modules=["q_proj", "v_proj"])

    engine = new_engine(base_dir)
    engine.warmup(512, 512, 16, max_active_adapters=2, max_lora_rank=8)
    for slot, (name, directory) in enumerate((("own", adapter_dir), ("plain", plain_dir))):
        engine.lora.load(name, "local", str(directory))
        engine.activate_adapter(name, slot)

    grammar = json_grammar(SCHEMA)
    for sampling in ({}, {"temperature": 1.0, "seed": 11}):
        blocks = Blocks()
        outputs = generate(engine, [
            request(1, PROMPT, blocks, grammar=grammar, adapter_id="own", **sampling),
            request(2, PROMPT, blocks, grammar=grammar, **sampling),
            request(3, PROMPT, blocks, grammar=grammar, adapter_id="plain", **sampling),
        ])
        jsonschema.validate(json.loads(text(own_tokenizer, outputs[1])), SCHEMA)
        jsonschema.validate(json.loads(text(base_tokenizer, outputs[2])), SCHEMA)
        jsonschema.validate(json.loads(text(base_tokenizer, outputs[3])), SCHEMA)
        # The base tokenizer reads the adapter's ids as other text: the mask was not the base's.
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(text(base_tokenizer, outputs[1])), SCHEMA)


def test_grammars_for_an_adapter_that_is_not_loaded_are_refused(tmp_path: Path) -> None:
    base_dir, _ = build_grammar_model(tmp_path / "base")
    engine = new_engine(base_dir)
    with pytest.raises(ValueError, match="adapter 'ghost' is not loaded"):
        engine.grammars.pin(1, "ghost", json_grammar(SCHEMA))
    assert engine.grammars.pinned_count == 0
