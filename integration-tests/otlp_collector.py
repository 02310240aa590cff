"""An OTLP/gRPC trace collector in the test process: the `TraceService` of opentelemetry-proto
(the protocol's own generated code) on a loopback port, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class CollectedSpan:
    service: str  # the exporting process's resource `service.name`
    name: str
    trace_id: str  # lowercase hex, as in `traceparent`
    span_id: str
    parent_span_id: str  # "" for a root span
    links: tuple[tuple[str, str], ...]  # (trace id, span id) of each link


def _service_name(attributes: list[common_pb2.KeyValue]) -> str:
    for attribute in attributes:
        if attribute.key == "service.name":
            return str(attribute.value.string_value)
    return ""


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._arrived = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Collector:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def Export(  # noqa: N802  (the service's method name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = [
            CollectedSpan(
                service=_service_name(list(resource_spans.resource.attributes)),
                name=span.name,
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(),
                links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
            )
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self._arrived:
            self._spans.extend(received)
            self._arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[CollectedSpan]:
        with self._arrived:
            return list(self._spans)

    def wait_until(self, done: Callable[[list[CollectedSpan]], bool], timeout_s: float) -> list[CollectedSpan]:
        """Waits for exports until `done(spans)` holds; raises at the deadline with what came."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not done(self._spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = sorted({(s.service, s.name) for s in self._spans})
                    raise AssertionError(f"spans still incomplete after {timeout_s} s; got {names}")
                self._arrived.wait(remaining)
            return list(self._spans)
