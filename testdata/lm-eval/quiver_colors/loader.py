"""The quiver_colors task's data: `questions.json` beside this file (see ../README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

QUESTIONS = Path(__file__).resolve().parent / "questions.json"


def load(**_metadata: Any) -> dict[str, datasets.Dataset]:
    """lm-eval calls this with the task's metadata as keyword arguments; none is needed."""
    rows = json.loads(QUESTIONS.read_text(encoding="utf-8"))
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}
