"""OpenTelemetry spans for the shard's work, exported over OTLP/gRPC (`--otlp-endpoint`).

The router sends the W3C `traceparent` of its Prefill/Decode step (or adapter load) in the gRPC
metadata; each traced call gets a server span that is that step's child, so a request's trace
covers router and shards. A call without `traceparent` (tracing off in the router, Health,
Info) gets no span: the shard never starts traces of its own.

Off by default: `opentelemetry` is imported only when tracing is turned on, and no exporter
thread exists otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

logger = logging.getLogger(__name__)

UnaryHandler = Callable[[Any, aio.ServicerContext], Awaitable[Any]]

# The calls that do a request's work; the rest (Health, Info, Warmup) are never traced.
TRACED_METHODS = frozenset(
    {"Prefill", "Decode", "FilterBatch", "LoadAdapter", "ActivateAdapter", "UnloadAdapter", "CompileGrammar"}
)
SCOPE = "quiver-server"


class TracingUnavailableError(RuntimeError):
    pass


def start_exporter(endpoint: str, service_name: str, rank: int) -> TracerProvider:
    """A tracer provider that batches spans to the OTLP/gRPC collector at `endpoint`."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise TracingUnavailableError(
            f"--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter ({error.name} is missing)"
        ) from error
    resource = Resource.create({"service.name": service_name, "quiver.rank": rank})
    provider = TracerProvider(resource=resource)
    # Plain gRPC to a collector, as the router's exporter (an https:// endpoint uses TLS).
    insecure = not endpoint.startswith("https://")
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
    logger.info("exporting traces over OTLP/gRPC to %s as %s", endpoint, service_name)
    return provider


class TracingInterceptor(aio.ServerInterceptor):
    """Wraps each traced call that carries a `traceparent` in a span that is its child."""

    def __init__(self, provider: TracerProvider, rank: int) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer: Tracer = provider.get_tracer(SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._rank = rank

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_method: str = handler_call_details.method
        service, _, method = full_method.lstrip("/").rpartition("/")
        if handler is None or handler.unary_unary is None or method not in TRACED_METHODS:
            return handler
        carrier = {key: value for key, value in handler_call_details.invocation_metadata or ()
                   if isinstance(value, str)}
        if "traceparent" not in carrier:
            return handler
        parent = self._propagator.extract(carrier)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "quiver.rank": self._rank}
        wrapped = self._traced(f"{service}/{method}", parent, attributes, handler.unary_unary)
        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _traced(self, name: str, parent: Any, attributes: dict[str, Any], behaviour: UnaryHandler) -> UnaryHandler:
        from opentelemetry.trace import SpanKind

        async def traced(request: Any, context: aio.ServicerContext) -> Any:
            # The span's status follows the exception (an abort included) that leaves it.
            with self._tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                                    attributes=attributes):
                return await behaviour(request, context)

        return traced
