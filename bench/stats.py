"""Percentiles for the report (nearest-rank on sorted samples, in seconds), and the median of a
row's repeats."""

from __future__ import annotations

import math
import statistics


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def percentiles(samples: list[float]) -> dict[str, float | int]:
    if not samples:
        return {"count": 0}
    return {
        "p50": round(percentile(samples, 50), 6),
        "p99": round(percentile(samples, 99), 6),
        "mean": round(sum(samples) / len(samples), 6),
        "count": len(samples),
    }


def with_median(row: dict) -> dict:
    """A best-of row with the median of all its runs' throughput (what the docs quote)."""
    return {**row, "throughput_tok_s_median": round(statistics.median(row["throughput_tok_s_all_runs"]), 2)}
