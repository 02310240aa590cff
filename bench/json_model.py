"""The bench model with a tokenizer that can spell JSON, for the structured-output scenarios.

The bench model's own tokenizer has only words ("w3" … "w31999") and no decoder: no `{`, no
`"`, and llguidance cannot even read it ("can't determine decoder type"). This writes a sibling
model directory (`<model>-json`) whose weights are the bench model's (hard-linked, the same
random weights) and whose tokenizer is a byte-level BPE of the same size, every token printable
ASCII:

- ids 0-2: `<unk>`, `<s>`, `</s>` as before (EOS is 2);
- the printable ASCII characters one by one (so any JSON can be spelled);
- JSON punctuation pieces (`{"`, `":"`, `","`...), and the property names and enum values the
  bench schemas use (schemas.KEYS, ENUM_VALUES), as real tokenizers have common keys and
  punctuation runs as single tokens;
- the rest " w<id>" words, which decode to their own whole text as the bench tokenizer's do.

No token is a partial UTF-8 character, so every generated token is its own streamed chunk and
inter-token latency stays per token. There are no merges: prompts are sent as token ids, and
llguidance only needs each token's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import schemas

RECIPE = 1  # bump when the vocabulary below changes: the directory is rewritten
SPECIAL = ["<unk>", "<s>", "</s>"]
PIECES = ['{"', '":', '":"', '","', ',"', '"}', '"]', '["', '"},{"', '},{', '":{"', '":["', '":[', '],"',
          'true', 'false', 'null']


def _byte_level(text: str) -> str:
    """`text` in the byte-level alphabet (GPT-2's byte-to-unicode map: printable ASCII other
    than space stays itself)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return "".join(mapping[b] for b in text.encode())


def vocabulary(vocab_size: int) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIAL)}

    def add(text: str) -> None:
        vocab.setdefault(_byte_level(text), len(vocab))

    for code in range(0x20, 0x7F):
        add(chr(code))
    for text in (*PIECES, *schemas.KEYS, *schemas.ENUM_VALUES):
        add(text)
    word = len(vocab)
    while len(vocab) < vocab_size:
        add(f" w{word}")
        word += 1
    return vocab


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocabulary(vocab_size), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (the weights are not copied; a symlink would be refused, the router reads no
    model file that leads outside the model's directory), a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def ensure_json_model(model_dir: Path, vocab_size: int) -> Path:
    """`<model_dir>-json`, written once per recipe (RECIPE, the bench model's path and shape):
    the bench model's files linked, the JSON tokenizer written."""
    model_dir = model_dir.resolve()
    out = model_dir.parent / f"{model_dir.name}-json"
    marker = out / "bench-json-tokenizer.json"
    shape_marker = model_dir / "bench-shape.json"
    recipe = {"recipe": RECIPE, "model": str(model_dir), "vocab_size": vocab_size,
              "shape": json.loads(shape_marker.read_text()) if shape_marker.exists() else None,
              "keys": list(schemas.KEYS), "enum_values": list(schemas.ENUM_VALUES)}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for source in model_dir.iterdir():
        if source.name.startswith("tokenizer") or source.name == "special_tokens_map.json" \
                or source.name.startswith("bench-"):
            continue
        target = out / source.name
        if target.is_symlink() or target.exists():
            target.unlink()
        _link_or_copy(source, target)
    _write_tokenizer(out, vocab_size)
    marker.write_text(json.dumps(recipe))
    return out
