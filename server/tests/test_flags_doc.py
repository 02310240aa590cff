"""docs/flags.md's "shard default" cells say what the shard really uses.

The launcher passes those flags on only when set, so their defaults live in the shard's parser,
out of reach of the launcher's own docs test (launcher/src/args.rs)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from quiver_server.cli import build_parser

FLAGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
# | `--flag` | `ENV` | shard default[:] `value`[ ...] | meaning |
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| [^|]* \| shard default:? `([^`]+)`")


def _serve_defaults() -> dict[str, object]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.default for action in subparsers.choices["serve"]._actions for flag in action.option_strings}


def test_shard_defaults_in_the_flags_doc_are_the_shard_s() -> None:
    defaults = _serve_defaults()
    rows = [match.groups() for line in FLAGS_DOC.read_text().splitlines() if (match := ROW.match(line))]
    assert len(rows) >= 5, rows  # the pattern still finds the table's rows
    for flag, documented in rows:
        actual = defaults[flag]
        if isinstance(actual, (int, float)):
            assert float(documented) == actual, f"{flag}: docs say {documented}, the shard uses {actual}"
        else:
            assert documented == actual, f"{flag}: docs say {documented}, the shard uses {actual}"
