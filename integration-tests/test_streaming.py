"""Streaming: the joined deltas equal the non-streamed text, and the chunks have OpenAI's shape
(role first, exactly one finish_reason, a usage chunk when asked for, then the end).
The chunks' JSON is held against OpenAI's schema in test_openai_schema.py."""

from __future__ import annotations

MAX_TOKENS = 24
USAGE = {"include_usage": True}

PROMPTS = ["Hello", "東京と大阪", "🙂 🚀", "Once upon a time there was"]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Grüße aus Köln 🙂"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "東京?"}],
]


def _check_stream_envelope(chunks: list, final) -> None:
    """Common to chat and completions: one id, the requested model, usage last and only last,
    exactly one finish_reason, equal to the non-streamed one."""
    assert len(chunks) >= 2, f"a stream with a usage chunk has at least 2 chunks: {chunks}"
    assert len({c.id for c in chunks}) == 1, "all chunks of one stream share one id"
    assert {c.model for c in chunks} == {final.model}
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [], "with include_usage the last chunk has no choices"
    assert usage_chunk.usage is not None
    streamed, whole = usage_chunk.usage, final.usage
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        whole.prompt_tokens, whole.completion_tokens, whole.total_tokens)
    # The stream repeats the prompt just served: every full 16-token KV block of it but the one
    # holding its last token comes from the prefix cache.
    assert streamed.prompt_tokens_details is not None
    assert streamed.prompt_tokens_details.cached_tokens == (streamed.prompt_tokens - 1) // 16 * 16
    assert all(c.usage is None for c in body), "usage only on the last chunk"
    reasons = [ch.finish_reason for c in body for ch in c.choices if ch.finish_reason is not None]
    assert reasons == [final.choices[0].finish_reason], reasons
    assert body[-1].choices[0].finish_reason is not None, "finish_reason is on the last choice chunk"
    assert all(ch.index == 0 for c in body for ch in c.choices)


def test_chat_stream_joins_to_the_non_streamed_text(client, llama):
    for messages in CHATS:
        args = dict(model=llama.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        final = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options=USAGE))

        _check_stream_envelope(chunks, final)
        first = chunks[0].choices[0].delta
        assert first.role == "assistant", "the first chunk announces the assistant role"
        assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks[:-1])
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert joined == final.choices[0].message.content, messages


def test_completion_stream_joins_to_the_non_streamed_text(client, llama):
    for prompt in PROMPTS:
        args = dict(model=llama.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        final = client.completions.create(**args)
        chunks = list(client.completions.create(**args, stream=True, stream_options=USAGE))

        _check_stream_envelope(chunks, final)
        assert all(c.object == "text_completion" for c in chunks)
        joined = "".join(c.choices[0].text for c in chunks if c.choices)
        assert joined == final.choices[0].text, prompt


def test_stream_without_usage_ends_with_the_finish_chunk(client, llama):
    args = dict(model=llama.model, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks, "no chunks"
    assert all(c.usage is None for c in chunks), "usage only when stream_options asks for it"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [c for c in chunks if c.choices[0].finish_reason] == [chunks[-1]]


def test_stop_string_ends_output_and_is_never_streamed(client, llama):
    """The first few characters of the free-running output become a stop string: the output
    ends right before it, with finish_reason stop, streamed or not."""
    args = dict(model=llama.model, prompt="Once upon a time there was", max_tokens=MAX_TOKENS,
                temperature=0)
    free = client.completions.create(**args).choices[0].text
    # Two whole characters from the middle (random weights also produce U+FFFD for stray bytes;
    # a stop string made of those would test nothing useful).
    starts = [i for i in range(1, len(free) - 1) if "\ufffd" not in free[i:i + 2]]
    assert starts, f"the fixture should produce some text: {free!r}"
    cut = starts[len(starts) // 2]
    stop = free[cut:cut + 2]
    expected = free[: free.index(stop)]

    final = client.completions.create(**args, stop=[stop])
    assert final.choices[0].text == expected
    assert final.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**args, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
