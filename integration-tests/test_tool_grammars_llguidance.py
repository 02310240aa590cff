"""The router's tool-call grammars, checked by llguidance itself (the shard's engine): every
variant (5 formats × auto/required/named × parallel or not × markers as text or as added tokens,
and Mistral's v11 layout, whose `[ARGS]` is a token) validates without errors or warnings
against a real byte-level tokenizer, and canned replies go through an `LLMatcher` as they must:
well-formed calls accepted; an undeclared function, arguments outside the schema (for pythonic
calls, a value of the wrong type), a second call without parallel calls, text where a call is
required, refused.

The grammars come from the router's own code: its unit test `grammars_are_written_for_llguidance`
writes them when `QUIVER_TOOL_GRAMMAR_DIR` names a directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import llguidance
import pytest
import tokenizers

from model_builders import build_tokenizer
from stack import REPO_ROOT

# The markers' ids in the grammars (the router's unit tests use these), and the tokenizer's.
MARKERS = {"<tool_call>": 151657, "</tool_call>": 151658, "<|python_tag|>": 128010, "[TOOL_CALLS]": 5,
           "<|tool_call|>": 49153, "[ARGS]": 32}
FORMATS = ("hermes", "llama3_json", "mistral", "granite", "pythonic")
VARIANTS = 5 * 3 * 2 * 2 + 3 * 2


@pytest.fixture(scope="module")
def grammar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tool-grammars")
    subprocess.run(
        [os.environ.get("CARGO", "cargo"), "test", "--workspace", "--lib", "-q", "grammars_are_written_for_llguidance"],
        cwd=REPO_ROOT, env={**os.environ, "QUIVER_TOOL_GRAMMAR_DIR": str(out)}, check=True,
        capture_output=True)
    return out


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return (path / "tokenizer.json").read_text()


def _call(parser: str, name: str, args: dict) -> str:
    """One call as the grammar writes it: name first, compact arguments."""
    if parser == "pythonic":
        return f"{name}({', '.join(f'{key}={value!r}' for key, value in args.items())})"
    compact = json.dumps(args, separators=(",", ":"))
    if parser == "mistral_v11":
        return f"{name}[ARGS]{compact}"
    key = "parameters" if parser == "llama3_json" else "arguments"
    return f'{{"name": "{name}", "{key}": {compact}}}'


def _replies(parser: str, mode: str, parallel: bool) -> list[tuple[str, bool]]:
    """(reply, accepted?) pairs for one grammar variant."""
    good = _call(parser, "get_weather", {"city": "Paris", "days": 3})
    time = _call(parser, "get_time", {})
    bad_name = _call(parser, "launch", {})
    # Outside the schema: the JSON formats hold `maximum`, pythonic calls the value's type.
    bad_args = _call(parser, "get_weather", {"city": "Paris", "days": "3" if parser == "pythonic" else 9})
    wrap = {
        "hermes": lambda calls: "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls),
        "llama3_json": lambda calls: "; ".join(calls),
        "mistral": lambda calls: "[TOOL_CALLS][{}]".format(", ".join(calls)),
        "mistral_v11": lambda calls: "".join(f"[TOOL_CALLS]{c}" for c in calls),
        "granite": lambda calls: "<|tool_call|>[{}]".format(", ".join(calls)),
        "pythonic": lambda calls: "[{}]".format(", ".join(calls)),
    }[parser]
    named = mode == "named"
    cases = [(wrap([good]), True), (wrap([bad_name]), False), (wrap([bad_args]), False),
             (wrap([good, time]), parallel and not named), (wrap([time]), not named),
             ("It is sunny.", mode == "auto")]
    if mode == "auto" and parser not in ("llama3_json", "pythonic"):
        cases += [("Let me check. " + wrap([good]), True), ("Let me check. " + wrap([bad_name]), False)]
    return cases


def test_every_variant_is_written(grammar_dir: Path) -> None:
    names = sorted(path.stem for path in grammar_dir.glob("*.lark"))
    assert len(names) == VARIANTS, names
    assert {name.split("-")[0] for name in names} == set(FORMATS)


@pytest.mark.parametrize("parser", FORMATS)
def test_grammars_validate_and_match_as_they_must(grammar_dir: Path, tokenizer_json: str, parser: str) -> None:
    mismatches = []
    for path in sorted(grammar_dir.glob(f"{parser}-*.lark")):
        _, mode, parallel, markers = path.stem.split("-")
        special = markers in ("special", "v11")
        layout = "mistral_v11" if markers == "v11" else parser
        tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        tok.add_tokens([tokenizers.AddedToken(marker, special=special) for marker in MARKERS])
        text = path.read_text()
        for marker, fixed in MARKERS.items():
            text = text.replace(f"<[{fixed}]>", f"<[{tok.token_to_id(marker)}]>")
        lltok = llguidance.LLTokenizer(tok.to_str() if special else tokenizer_json)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(text), lltok)
        assert not is_error and not messages, f"{path.name}: {messages}"
        for reply, accepted in _replies(layout, mode, parallel == "parallel"):
            # Special markers as their tokens; plain-text ones spelled out in ordinary tokens.
            tokens = tok.encode(reply, add_special_tokens=False).ids if special else lltok.tokenize_str(reply)
            matcher = llguidance.LLMatcher(lltok, text, log_level=0)
            got = matcher.consume_tokens(tokens) and not matcher.is_error() and matcher.is_accepting()
            if got != accepted:
                mismatches.append((path.name, reply, accepted, matcher.get_error().splitlines()[:1]))
    assert not mismatches, mismatches
