"""Checks the tool-call grammars the router builds with llguidance itself (the shard's engine).

`cargo test -p quiver-router --lib grammars_are_written_for_llguidance` writes every variant to
<tmp>/quiver-tool-grammars/; this script validates each one against a real tokenizer (with the
family markers added as special tokens for the `-special` variants) and runs canned replies
through an LLMatcher: well-formed calls must be accepted, calls of undeclared functions or with
arguments outside the schema refused.

Usage: python check_with_llguidance.py <tokenizer.json> [grammar dir]
(a byte-level tokenizer that spells "\n" as a token of its own)
"""

import pathlib
import sys
import tempfile

import llguidance
import tokenizers

MARKERS = {"<tool_call>": 151657, "</tool_call>": 151658, "<|python_tag|>": 128010,
           "[TOOL_CALLS]": 5}


def tokenizer_with_markers(path, special):
    """The markers as added tokens, special (Llama, Mistral) or not (Qwen's `<tool_call>`)."""
    tok = tokenizers.Tokenizer.from_file(path)
    tok.add_tokens([tokenizers.AddedToken(marker, special=special) for marker in MARKERS])
    ids = {marker: tok.token_to_id(marker) for marker in MARKERS}
    return tok, ids


def call(parser, name, args):
    key = "parameters" if parser == "llama3_json" else "arguments"
    return f'{{"name": "{name}", "{key}": {args}}}'


def replies(parser, mode, parallel):
    """(text, accepted?) pairs."""
    good = call(parser, "get_weather", '{"city":"Paris","days":3}')
    time = call(parser, "get_time", "{}")
    bad_name = call(parser, "launch", "{}")
    bad_args = call(parser, "get_weather", '{"city":"Paris","days":9}')
    wrap = {
        "hermes": lambda calls: "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls),
        "llama3_json": lambda calls: "; ".join(calls),
        "mistral": lambda calls: "[TOOL_CALLS][{}]".format(", ".join(calls)),
    }[parser]
    cases = [(wrap([good]), True), (wrap([bad_name]), False), (wrap([bad_args]), False)]
    named = mode == "named"
    cases.append((wrap([good, time]), parallel and not named))
    if mode != "named":
        cases.append((wrap([time]), True))
    else:
        cases.append((wrap([time]), False))
    cases.append(("It is sunny.", mode == "auto"))
    if mode == "auto" and parser != "llama3_json":
        cases.append(("Let me check. " + wrap([good]), True))
        cases.append(("Let me check. " + wrap([bad_name]), False))
    return cases


def main():
    failures = 0
    for special in (True, False):
        failures += check(special)
    sys.exit(1 if failures else 0)


def check(special_markers):
    tok, ids = tokenizer_with_markers(sys.argv[1], special_markers)
    grammar_dir = pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else
                               pathlib.Path(tempfile.gettempdir()) / "quiver-tool-grammars")
    special_tok = llguidance.LLTokenizer(tok.to_str())
    plain_tok = llguidance.LLTokenizer(pathlib.Path(sys.argv[1]).read_text())
    failures = 0
    files = sorted(grammar_dir.glob("*.lark"))
    for path in files:
        parser, mode, parallel, markers = path.stem.split("-")
        text = path.read_text()
        for marker, fixed in MARKERS.items():
            text = text.replace(f"<[{fixed}]>", f"<[{ids[marker]}]>")
        lltok = special_tok if markers == "special" else plain_tok
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_lark(text), lltok)
        if is_error or messages:
            print("INVALID" if is_error else "WARNINGS", path.name, messages)
            failures += 1
            continue
        for reply, accepted in replies(parser, mode, parallel == "parallel"):
            # Special markers as their tokens; plain-text ones spelled out in ordinary tokens.
            if markers == "special":
                tokens = tok.encode(reply, add_special_tokens=False).ids
            else:
                tokens = lltok.tokenize_str(reply)
            matcher = llguidance.LLMatcher(lltok, text, log_level=0)
            consumed = matcher.consume_tokens(tokens)
            got = consumed and not matcher.is_error() and matcher.is_accepting()
            if got != accepted:
                print("MISMATCH", path.name, repr(reply), "expected", accepted, "got", got,
                      matcher.get_error().splitlines()[:1])
                failures += 1
    print(f"{len(files)} grammars checked (markers added as "
          f"{'special' if special_markers else 'non-special'} tokens), {failures} failures")
    return failures if files else 1


if __name__ == "__main__":
    main()
