//! OpenTelemetry tracing, exported over OTLP/gRPC when `--otlp-endpoint` is set (docs/tracing.md).
//!
//! Off (the default), nothing here runs: no exporter, no thread, and every hook below is one
//! relaxed atomic load that returns at once ([`enabled`]). On, each HTTP request gets a server
//! span (parented on the client's W3C `traceparent`), validation and queue wait get child spans,
//! and every Prefill/Decode step gets a span of its own that is sent to the shards in the
//! `traceparent` gRPC metadata, so their spans join the same trace.

use std::sync::atomic::{AtomicBool, Ordering};

mod export;
mod http_span;
mod propagation;
mod steps;

pub use export::{init, Exporter, TelemetryError};
pub use http_span::trace_requests;
pub use propagation::{inject_current, parent_from_headers};
pub use steps::{within_step, RequestTrace, StepSpan};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether spans are recorded and exported (set once, by [`init`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A child span of the current one, named `name` in the exported trace; a disabled span (no
/// cost beyond the check) when tracing is off.
pub fn span(name: &'static str) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    tracing::info_span!(target: "quiver_router::telemetry", "quiver", otel.name = name)
}
