"""A client that disconnects mid-stream frees its KV blocks at once (issue 2, "Bad input"),
observed through the router's Prometheus gauges and counters."""

from __future__ import annotations

import time

from conftest import MAX_TOTAL_TOKENS

# Long enough that the request is certainly still generating when the client goes away.
LONG = MAX_TOTAL_TOKENS - 32
# Only a guard against a hang: the test waits for the router to report the blocks free, however
# long that takes on a loaded machine, and judges "at once" by decode steps, not by the clock.
GUARD_S = 60.0


def _series(metrics: dict[str, float], name: str) -> float:
    assert name in metrics, f"GET /metrics has no {name}: {sorted(metrics)}"
    return metrics[name]


def _wait_idle(stack, timeout_s: float) -> dict[str, float]:
    """Scrapes /metrics until every KV block is free and nothing runs; the scrape that saw it.

    Each scrape is a round trip to the router, which paces the loop; no sleep is needed."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = stack.metrics()
        free = _series(metrics, "quiver_kv_blocks_free")
        total = _series(metrics, "quiver_kv_blocks_total")
        running = _series(metrics, "quiver_requests_running")
        if free == total and running == 0:
            return metrics
        assert time.monotonic() < deadline, (
            f"not idle after {timeout_s:.0f}s: {free}/{total} blocks free, {running} running"
        )


def test_disconnect_mid_stream_frees_kv_blocks_at_once(client, llama):
    stack = llama.stack
    before = _wait_idle(stack, GUARD_S)
    total = _series(before, "quiver_kv_blocks_total")
    assert total > 0

    stream = client.chat.completions.create(
        model=llama.model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=LONG, stream=True, extra_body={"ignore_eos": True},
    )
    # Three streamed chunks: the request is certainly admitted, prefilled and decoding.
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    mid = stack.metrics()
    assert _series(mid, "quiver_kv_blocks_free") < total, "a running request holds KV blocks"
    assert _series(mid, "quiver_requests_running") == 1
    stream.close()  # the client goes away; the request had ~LONG tokens left

    after = _wait_idle(stack, GUARD_S)
    # The scrape that saw the blocks free read the decode counter after the running gauge, so
    # it counts every step the request took. Run to its end, the request would have taken
    # LONG - 1 decode steps (prefill gives the first token); fewer means the scheduler cancelled
    # it when the client left, rather than freeing it at completion.
    decode_steps = _series(after, "quiver_decode_steps_total") - _series(before, "quiver_decode_steps_total")
    assert decode_steps < LONG - 1, f"{decode_steps} decode steps: the request was not cancelled"
    # A client going away is not a server-side failure.
    assert _series(after, "quiver_requests_failed_total") == _series(before, "quiver_requests_failed_total")

    # And the server serves normally afterwards.
    response = client.chat.completions.create(model=llama.model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")
