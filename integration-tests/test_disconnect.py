"""A client that disconnects mid-stream frees its KV blocks at once (issue 2, "Bad input"),
observed through the router's Prometheus gauges."""

from __future__ import annotations

import time

from conftest import MAX_TOTAL_TOKENS

# Long enough that the request is certainly still generating when the client goes away.
LONG = MAX_TOTAL_TOKENS - 32
FREED_WITHIN_S = 2.0


def _gauge(metrics: dict[str, float], name: str) -> float:
    assert name in metrics, f"GET /metrics has no {name}: {sorted(metrics)}"
    return metrics[name]


def _idle(stack) -> tuple[float, float, float]:
    m = stack.metrics()
    return (_gauge(m, "quiver_kv_blocks_free"), _gauge(m, "quiver_kv_blocks_total"),
            _gauge(m, "quiver_requests_running"))


def _wait_idle(stack, timeout_s: float) -> tuple[float, float, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        free, total, running = _idle(stack)
        if (free == total and running == 0) or time.monotonic() > deadline:
            return free, total, running
        time.sleep(0.02)


def test_disconnect_mid_stream_frees_kv_blocks_at_once(client, llama):
    stack = llama.stack
    free, total, running = _wait_idle(stack, 10)
    assert total > 0 and free == total and running == 0, (free, total, running)
    generated_before = stack.metrics().get("quiver_generated_tokens_total")

    stream = client.chat.completions.create(
        model=llama.model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=LONG, stream=True, extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    free_mid, _, running_mid = _idle(stack)
    assert free_mid < total, "a running request holds KV blocks"
    assert running_mid == 1
    stream.close()  # the client goes away; the request had ~LONG tokens left
    closed_at = time.monotonic()

    free, total, running = _wait_idle(stack, FREED_WITHIN_S)
    elapsed = time.monotonic() - closed_at
    assert (free, running) == (total, 0), (
        f"{elapsed:.1f}s after the disconnect: {free}/{total} blocks free, {running} running"
    )
    if generated_before is not None:
        # It was cancelled, not run to completion (a finished request frees its blocks too).
        time.sleep(0.5)
        generated = stack.metrics()["quiver_generated_tokens_total"] - generated_before
        assert generated < LONG, f"{generated} tokens generated: the request was not cancelled"

    # And the server serves normally afterwards.
    response = client.chat.completions.create(model=llama.model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")
