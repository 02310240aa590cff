"""How hard the reliability tests push, and what they sent.

`make test` runs them at scale 1 (bounded: a few minutes on 2 cores). `make soak` sets
QUIVER_SOAK=1 and runs the same scenarios at SOAK_FACTOR times the examples and rounds
(QUIVER_SOAK_FACTOR overrides it), then reports the tally below as JSON (integration-tests/soak.py).
"""

from __future__ import annotations

import os
import threading
from collections import Counter

SOAK = os.environ.get("QUIVER_SOAK", "") not in ("", "0")
SOAK_FACTOR = int(os.environ.get("QUIVER_SOAK_FACTOR") or 10)


def scaled(n: int) -> int:
    return n * SOAK_FACTOR if SOAK else n


class Tally:
    """Requests sent, by outcome (an HTTP status, or a word for what had none); thread-safe,
    since the churn's clients record from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()

    def record(self, outcome: int | str) -> None:
        with self._lock:
            self.outcomes[str(outcome)] += 1

    def total(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())


# One per process: the soak runner reads it after pytest returns.
TALLY = Tally()
