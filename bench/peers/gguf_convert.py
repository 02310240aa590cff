"""The bench model and its LoRA adapters as GGUF files for llama.cpp's llama-server, made by
llama.cpp's own converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, vendored with the
llama-server build) in float32, the dtype quiver and vLLM serve.

The bench tokenizer is a transformers WordLevel tokenizer (bench/fixtures/bench_model.py), which the converter
does not take: for a Llama it reads a SentencePiece `tokenizer.model` first, then a BPE
tokenizer.json. A SentencePiece model is written here with the same vocabulary at the same ids —
id 0 `<unk>` (UNKNOWN), 1 `<s>` and 2 `</s>` (CONTROL), then `▁w3` … `▁w31999` (NORMAL) — so
every id means the same token and decodes to the same word (`▁` is SentencePiece's space): the
bench sends token-id prompts, and the greedy check compares the generated words. Text
tokenization differs (SentencePiece's unigram segmentation, not whitespace splitting), which no
scenario uses.

The converters run in this repository's venv with `sentencepiece` from a private target
(.cache/peers/convert-py) and the vendored gguf-py on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.fixtures import bench_model

MARKER = "gguf-source.json"


def write_sentencepiece_model(path: Path, vocab_size: int) -> None:
    """A SentencePiece model whose piece i is the bench tokenizer's token i."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    model = spm.ModelProto()
    kinds = [spm.ModelProto.SentencePiece.UNKNOWN, spm.ModelProto.SentencePiece.CONTROL,
             spm.ModelProto.SentencePiece.CONTROL]
    for token, kind in zip(bench_model.SPECIAL, kinds, strict=True):
        model.pieces.add(piece=token, score=0.0, type=kind)
    for i in range(len(bench_model.SPECIAL), vocab_size):
        model.pieces.add(piece=f"\u2581w{i}", score=-float(i), type=spm.ModelProto.SentencePiece.NORMAL)
    model.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    model.trainer_spec.vocab_size = vocab_size
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.trainer_spec.pad_id = -1
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = True
    path.write_bytes(model.SerializeToString())


def converter_env(llama_dir: Path, convert_py: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(convert_py), str(llama_dir / "src" / "gguf-py")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_converter(arguments: list[str], env: dict[str, str], log_path: Path) -> None:
    """One of llama.cpp's converter scripts with its arguments, in this venv's Python."""
    _run([sys.executable, *arguments], env, log_path)


def _run(command: list[str], env: dict[str, str], log_path: Path) -> None:
    with open(log_path, "ab") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        name = command[2] if command[1] == "-m" else Path(command[1]).name
        raise RuntimeError(f"{name} exited with {done.returncode}: {tail}")


def convert(model_dir: Path, adapter_root: Path, adapter_ids: list[str], llama_dir: Path,
            convert_py: Path, out_dir: Path) -> tuple[Path, dict[str, Path]]:
    """(base GGUF, {adapter id: LoRA GGUF}) under out_dir. The base is converted once per model
    and converter; each adapter once (a run with more adapters converts only the new ones; an
    adapter's file is renamed into place only when its conversion succeeded)."""
    model_dir = model_dir.resolve()
    recipe = {"model_config": json.loads((model_dir / "config.json").read_text()),
              "adapter_root": str(adapter_root.resolve()), "converter": str(llama_dir), "outtype": "f32"}
    base = out_dir / "model-f32.gguf"
    loras = {a: out_dir / f"lora-{a}-f32.gguf" for a in adapter_ids}
    marker = out_dir / MARKER
    source = out_dir / "hf-source"
    env = converter_env(llama_dir, convert_py)
    log_path = out_dir / "convert.log"
    src = llama_dir / "src"
    if not (marker.exists() and json.loads(marker.read_text()) == recipe and base.exists()):
        shutil.rmtree(out_dir, ignore_errors=True)
        source.mkdir(parents=True)
        # The model's files as they are, plus the SentencePiece form of its vocabulary.
        for item in model_dir.iterdir():
            if item.is_file() and item.name != "bench-shape.json":
                (source / item.name).symlink_to(item)
        # Written in the converters' environment (convert_py holds the sentencepiece they use).
        _run([sys.executable, "-m", "bench.peers.gguf_convert", str(source / "tokenizer.model"),
              str(recipe["model_config"]["vocab_size"])], env, log_path)
        _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(source), "--outtype", "f32",
              "--outfile", str(base)], env, log_path)
        marker.write_text(json.dumps(recipe))
    for adapter_id, path in loras.items():
        if path.exists():
            continue
        partial = path.with_suffix(".partial")
        _run([sys.executable, str(src / "convert_lora_to_gguf.py"), str(adapter_root / adapter_id),
              "--base", str(source), "--outtype", "f32", "--outfile", str(partial)], env, log_path)
        partial.rename(path)
    return base, loras


if __name__ == "__main__":
    # `python -m bench.peers.gguf_convert OUT VOCAB_SIZE`: convert() runs it with the converters' PYTHONPATH.
    write_sentencepiece_model(Path(sys.argv[1]), int(sys.argv[2]))
