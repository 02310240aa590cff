"""Chat prompts of realistic lengths for the real-model benchmarks, as token ids rendered by the
model's own chat template (what the router renders: the integration tests prove the two equal).

A chat frontend's traffic is mostly short questions with some long requests that carry a text to
work on. Here: a third are short questions; the rest ask for a summary, an explanation or a
rewrite of an excerpt of English prose (the docstrings that ship with Python, as the tiny
model's tokenizer trainer uses), excerpts 300 to 2,400 characters long. About half the
conversations open with a system prompt. Seeded: the same list every run, for every server."""

from __future__ import annotations

import random

from quiver_server.tiny_model import training_corpus

QUESTIONS = [
    "What is the capital of France?",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What are three tips for staying focused while studying?",
    "Explain what a database index is.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "How many legs does a spider have?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly robot.",
    "How does a bicycle stay upright?",
]
TASKS = [
    "Summarize the following text in three sentences.",
    "Explain the following passage to a beginner.",
    "Rewrite the following text in plain, simple English.",
    "List the main points of the following text.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
]


def conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    texts = [" ".join(text.split()) for text in training_corpus() if len(text) > 400]
    chats = []
    for index in range(count):
        if index % 3 == 0:
            user = rng.choice(QUESTIONS)
        else:
            text = rng.choice(texts)
            length = rng.randint(300, 2400)
            start = rng.randint(0, max(0, len(text) - length))
            user = f"{rng.choice(TASKS)}\n\n{text[start:start + length]}"
        chat = [{"role": "user", "content": user}]
        if rng.random() < 0.5:
            chat.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        chats.append(chat)
    return chats


def prompt_ids(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """The conversations rendered with a generation prompt and tokenized, as the router does."""
    prompts = []
    for chat in conversations(count, seed):
        encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def length_summary(prompts: list[list[int]]) -> dict:
    lengths = sorted(len(p) for p in prompts)
    return {"count": len(lengths), "min": lengths[0], "p50": lengths[len(lengths) // 2],
            "p90": lengths[int(len(lengths) * 0.9)], "max": lengths[-1],
            "mean": round(sum(lengths) / len(lengths), 1)}
