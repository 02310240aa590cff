"""The shard's tracing interceptor on a real grpc.aio server: a call that carries the router's
`traceparent` gets a server span that is its child (same trace, parent = the caller's span);
calls without one, and untraced methods, get none; a failed call's span is an error."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import grpc
from grpc import aio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.tracing_spans import TracingInterceptor


class StepsOnly(shard_pb2_grpc.ShardServicer):
    """Answers Health and Prefill; Decode fails as a shard error would."""

    async def Health(self, request, context):  # noqa: N802
        return shard_pb2.HealthResponse()

    async def Prefill(self, request, context):  # noqa: N802
        return shard_pb2.PrefillResponse()

    async def Decode(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown batch")


def _call_all(socket: Path, traceparent: str) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def run() -> None:
        server = aio.server(interceptors=[TracingInterceptor(provider, rank=1)])
        shard_pb2_grpc.add_ShardServicer_to_server(StepsOnly(), server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        try:
            async with aio.insecure_channel(f"unix://{socket}") as channel:
                stub = shard_pb2_grpc.ShardStub(channel)
                traced = (("traceparent", traceparent),)
                await stub.Prefill(shard_pb2.PrefillRequest(batch_id=1), metadata=traced)
                await stub.Prefill(shard_pb2.PrefillRequest(batch_id=2))  # no traceparent
                await stub.Health(shard_pb2.HealthRequest(), metadata=traced)  # never traced
                try:
                    await stub.Decode(shard_pb2.DecodeRequest(), metadata=traced)
                except aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(None)

    asyncio.run(run())
    return list(exporter.get_finished_spans())


def test_traced_calls_are_children_of_the_callers_span(tmp_path):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    spans = _call_all(tmp_path / "s.sock", f"00-{trace_id}-{caller_span}-01")
    assert [span.name for span in spans] == ["quiver.v1.Shard/Prefill", "quiver.v1.Shard/Decode"]
    for span in spans:
        assert span.context is not None and span.parent is not None
        assert format(span.context.trace_id, "032x") == trace_id
        assert format(span.parent.span_id, "016x") == caller_span
        assert span.kind is SpanKind.SERVER
        assert span.attributes is not None and span.attributes["quiver.rank"] == 1
    prefill, decode = spans
    assert prefill.status.status_code is StatusCode.UNSET
    assert decode.status.status_code is StatusCode.ERROR
