"""The benchmark's model: random weights in a real Llama shape, written with `save_pretrained`.

Shapes are picked per device: a ~58M-parameter Llama on CPU (what a laptop or CI box can drive),
Llama-2-7B's shape in bfloat16 on CUDA. The tokenizer is a word-level vocabulary of the model's
full size ("w3" … "w31999"): every id the random model can emit decodes to whole text, so each
generated token becomes its own streamed chunk and inter-token latency is measured per token.
`write_model` writes any transformers config so, with the same tokenizer (family_shapes.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    dtype: str

    def parameters(self) -> int:
        h, i, layers, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        kv = h * self.num_key_value_heads // self.num_attention_heads
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
        return layers * per_layer + 2 * v * h + h


SHAPES = {
    "cpu": Shape("llama-58m", 512, 1408, 8, 8, 8, 32000, "float32"),
    "cuda": Shape("llama-2-7b-shape", 4096, 11008, 32, 32, 32, 32000, "bfloat16"),
    # For `--quick` smoke runs: seconds, not minutes.
    "tiny": Shape("llama-tiny", 128, 352, 2, 4, 2, 32000, "float32"),
}


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def ensure_model(shape: Shape, root: Path, device: str) -> Path:
    """Writes the model once under `root/<shape name>` and returns its directory."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        dtype=shape.dtype,
    )
    return write_model(config, shape.dtype, root / shape.name, device, asdict(shape))


def write_model(config, dtype: str, out: Path, device: str, recipe: dict) -> Path:
    """Random weights of any transformers `config` with the bench tokenizer, written into `out`
    with `save_pretrained` unless `out` already holds this `recipe` (a JSON-able description of
    the shape: a changed shape rewrites the model)."""
    marker = out / "bench-shape.json"
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    # Initialise where it is fast: 7B parameters take minutes to draw on a CPU.
    init_device = "cuda" if device == "cuda" else "cpu"
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _write_tokenizer(out, config.vocab_size)
    del model
    release_device_memory()
    marker.write_text(json.dumps(recipe))
    return out


def release_device_memory() -> None:
    """Hands cached CUDA memory back, so the shard (a separate process) can size its KV cache."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` different token-id prompts of exactly `length` tokens (no special ids)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL), vocab_size, (count, length), generator=generator)
    return ids.tolist()
