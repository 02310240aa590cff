"""The files that make a model directory a sentence-transformers pipeline: `modules.json`
naming the transformer, a Pooling and a Normalize module, and the Pooling config. The shard
reads them to pool embeddings; `SentenceTransformer(dir)` reads them as the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# sentence-transformers' own module classes, as its current releases name them in modules.json.
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling",
     "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"},
]


def write_pipeline(model_dir: Path, pooling: dict[str, Any]) -> None:
    """Transformer, then Pooling with config `pooling`, then Normalize."""
    (model_dir / "modules.json").write_text(json.dumps(MODULES))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (model_dir / "2_Normalize").mkdir()
