"""Tracing (`--otlp-endpoint`, docs/tracing.md): one request sent with a client `traceparent`
reaches the collector as one trace, the client's, whose spans come from the router and the
shard and chain back to the client's span; with tracing off nothing is exported."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from conftest import SHARD_ENV
from otlp_collector import CollectedSpan, Collector
from stack import Stack, StackConfig

SERVICE = "quiver-test"
SHARD_SERVICE = f"{SERVICE}-shard"
HTTP_SPAN = "POST /v1/chat/completions"
ROUTER_SPANS = {HTTP_SPAN, "validate", "queue", "prefill", "decode"}
SHARD_PREFILL = "quiver.v1.Shard/Prefill"
SHARD_DECODE = "quiver.v1.Shard/Decode"
MAX_TOKENS = 3
# The exporters batch spans for up to 5 s; the stack shares 2 cores with the test.
EXPORT_TIMEOUT_S = 60.0
# The machine is shared: the shard can take more than a minute to load.
STARTUP_TIMEOUT_S = 240.0
# The Rust SDK's batch exporter thread ("OpenTelemetry.Traces.BatchProcessor", cut to 15 bytes).
EXPORTER_THREAD = "OpenTelemetry.T"


def _stack_config(pool, extra_args: list[str], extra_env: dict[str, str]) -> StackConfig:
    return StackConfig(model_id=str(pool.model_dir("llama")), served_model_name="tiny",
                       extra_args=extra_args, extra_env={**SHARD_ENV, **extra_env})


@contextmanager
def _serving(config: StackConfig, log: Path) -> Iterator[Stack]:
    stack = Stack(config, log).start(timeout_s=STARTUP_TIMEOUT_S)
    try:
        yield stack
    finally:
        stack.stop()


def _ask(stack: Stack, traceparent: str) -> int:
    """One chat completion sent with `traceparent`; returns its completion token count."""
    with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
            extra_headers={"traceparent": traceparent}, extra_body={"ignore_eos": True})
    assert reply.usage is not None
    return reply.usage.completion_tokens


def _router_threads(stack: Stack) -> list[str]:
    router = [pid for pid, cmdline in stack.descendants() if "quiver-router" in cmdline.split(" ")[0]]
    assert len(router) == 1, stack.descendants()
    return [task.joinpath("comm").read_text().strip()
            for task in Path(f"/proc/{router[0]}/task").iterdir()]


def _in_trace(spans: list[CollectedSpan], trace_id: str) -> list[CollectedSpan]:
    return [span for span in spans if span.trace_id == trace_id]


def test_one_request_is_one_trace_across_router_and_shard(pool, tmp_path):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{trace_id}-{client_span}-01"
    with Collector() as collector:
        config = _stack_config(pool, ["--otlp-endpoint", collector.endpoint, "--otel-service-name", SERVICE], {})
        with _serving(config, tmp_path / "tracing.log") as stack:
            assert EXPORTER_THREAD in _router_threads(stack)
            completion_tokens = _ask(stack, traceparent)
            assert completion_tokens == MAX_TOKENS
            # The first token comes from the prefill, each further one from a decode step.
            decode_steps = completion_tokens - 1

            def complete(spans: list[CollectedSpan]) -> bool:
                mine = _in_trace(spans, trace_id)
                names = [span.name for span in mine]
                return (ROUTER_SPANS <= set(names) and SHARD_PREFILL in names
                        and names.count("decode") == decode_steps and names.count(SHARD_DECODE) == decode_steps)

            spans = collector.wait_until(complete, EXPORT_TIMEOUT_S)

    # The start-up probes of /health are not traced (they would bury the requests' traces).
    assert not [span for span in spans if span.name == "GET /health"]
    mine = _in_trace(spans, trace_id)
    by_id = {span.span_id: span for span in mine}
    assert len(by_id) == len(mine), "span ids are unique"
    services = {span.service for span in mine}
    assert services == {SERVICE, SHARD_SERVICE}

    def only(name: str) -> CollectedSpan:
        found = [span for span in mine if span.name == name]
        assert len(found) == 1, (name, found)
        return found[0]

    # The request's span is the child of the client's span; every other span descends from it.
    http = only(HTTP_SPAN)
    assert (http.service, http.parent_span_id) == (SERVICE, client_span)
    for span in mine:
        chain = [span]
        while chain[-1].parent_span_id != client_span:
            parent = by_id.get(chain[-1].parent_span_id)
            assert parent is not None, f"{span.name}: parent {chain[-1].parent_span_id} not in the trace"
            assert parent not in chain, "parent chain loops"
            chain.append(parent)
        assert chain[-1] == http, span.name

    for name in ("validate", "queue", "prefill"):
        assert (only(name).service, only(name).parent_span_id) == (SERVICE, http.span_id), name
    router_decodes = [span for span in mine if span.name == "decode"]
    assert all((s.service, s.parent_span_id) == (SERVICE, http.span_id) for s in router_decodes)
    # Each shard call is the child of the router's step that made it, one call per step.
    shard_prefill = only(SHARD_PREFILL)
    assert (shard_prefill.service, shard_prefill.parent_span_id) == (SHARD_SERVICE, only("prefill").span_id)
    shard_decodes = [span for span in mine if span.name == SHARD_DECODE]
    assert all(span.service == SHARD_SERVICE for span in shard_decodes)
    assert sorted(s.parent_span_id for s in shard_decodes) == sorted(s.span_id for s in router_decodes)


def test_tracing_off_exports_nothing(pool, tmp_path):
    """Without --otlp-endpoint no exporter runs, even with the SDKs' standard endpoint variable
    pointing at a live collector, and a client's `traceparent` is simply accepted."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with Collector() as collector:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
        with _serving(_stack_config(pool, [], env), tmp_path / "tracing-off.log") as stack:
            assert EXPORTER_THREAD not in _router_threads(stack)
            assert not any("--otlp-endpoint" in cmdline for _, cmdline in stack.descendants())
            assert _ask(stack, f"00-{trace_id}-{client_span}-01") == MAX_TOKENS
            assert "ERROR" not in stack.log()
        # The stack has exited: an exporter would have flushed its spans on the way out.
        assert collector.spans() == []
