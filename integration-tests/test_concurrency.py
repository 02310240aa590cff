"""Batching must not change results: 32 concurrent requests (mixed prompt lengths, max_tokens,
endpoints, greedy and seeded sampling, some streamed) give exactly what each gives alone."""

from __future__ import annotations

import asyncio

from served import RETURN_TOKEN_IDS, token_ids

_WORDS = ("the quick brown fox jumps over the lazy dog 東京 🙂 Grüße aus Köln and a server "
          "batches many requests ").split()


def _requests(model: str) -> list[dict]:
    """32 different requests; deterministic, so the sequential and concurrent runs agree."""
    requests = []
    for i in range(32):
        prompt = " ".join(_WORDS[j % len(_WORDS)] for j in range(i, i + 1 + (i * 7) % 40))
        sampling: dict[str, float] = {"temperature": 0}
        if i % 4 == 3:
            # Seeded sampling uses the request's own generator: also batch-independent.
            sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 1000 + i}
        common = dict(model=model, max_tokens=8 + (i * 11) % 57, **sampling)
        if i % 2 == 0:
            requests.append({"kind": "completion", "prompt": prompt, **common})
        else:
            requests.append({"kind": "chat", "messages": [{"role": "user", "content": prompt}],
                             **common})
        requests[-1]["stream"] = i % 8 in (5, 6)
    return requests


async def _run(client, request: dict) -> tuple:
    """(text, finish_reason, token ids or None when streamed)."""
    args = {k: v for k, v in request.items() if k not in ("kind", "stream")}
    create = client.completions.create if request["kind"] == "completion" else client.chat.completions.create
    if request["stream"]:
        parts, reason = [], None
        async for chunk in await create(**args, stream=True):
            for choice in chunk.choices:
                parts.append(choice.text if request["kind"] == "completion" else choice.delta.content or "")
                reason = choice.finish_reason or reason
        return "".join(parts), reason, None
    response = await create(**args, extra_body=RETURN_TOKEN_IDS)
    choice = response.choices[0]
    text = choice.text if request["kind"] == "completion" else choice.message.content
    return text, choice.finish_reason, token_ids(response)


def test_32_concurrent_requests_equal_the_same_requests_one_at_a_time(llama):
    requests = _requests(llama.model)

    async def peak_running(done: asyncio.Event) -> float:
        """Most requests seen running at once: proves the concurrent ones really shared a batch.

        Scrapes back to back: each is a round trip to the router (on a worker thread, so the
        requests proceed meanwhile), which paces the sampling."""
        peak = 0.0
        while not done.is_set():
            metrics = await asyncio.to_thread(llama.stack.metrics)
            peak = max(peak, metrics["quiver_requests_running"])
        return peak

    async def main():
        async with llama.async_client() as client:
            alone = [await _run(client, r) for r in requests]
            done = asyncio.Event()
            watcher = asyncio.create_task(peak_running(done))
            together = await asyncio.gather(*(_run(client, r) for r in requests))
            done.set()
        return alone, together, await watcher

    alone, together, peak = asyncio.run(main())
    assert peak >= 8, f"at most {peak} requests ran at once: they were not batched"
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a == b, f"request {i} ({requests[i]}) differs in a batch:\nalone    {a}\ntogether {b}"
    # The mix really has both endings and sampled requests that are not all identical.
    assert {a[1] for a in alone} == {"stop", "length"}
