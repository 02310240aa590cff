//! Spans the batching loop records: each request's queue wait, and one span per Prefill or
//! Decode step. A step serves many requests, from as many traces; its span is a child of the
//! oldest traced request in the batch and carries a link to every other one, so each request's
//! trace shows (or links to) every step it took part in. The step's context is what the shard
//! client sends on in `traceparent`, so the shards' spans are children of the step.

use std::future::Future;
use std::time::SystemTime;

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{Link, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::enabled;

/// The instrumentation scope of the spans made here (the same as the request spans').
const SCOPE: &str = "quiver-router";

/// One request's place in its trace, carried through the scheduler with it.
#[derive(Debug, Clone)]
pub struct RequestTrace {
    /// The HTTP request's span, parent of the queue span and of the steps it leads.
    context: Context,
    /// When it (last) joined the queue.
    queued_at: SystemTime,
}

impl RequestTrace {
    /// The current request's trace, taken as it is queued; `None` when tracing is off.
    pub fn current() -> Option<Self> {
        if !enabled() {
            return None;
        }
        Some(Self {
            context: tracing::Span::current().context(),
            queued_at: SystemTime::now(),
        })
    }

    /// Records the wait that just ended (admitted into a prefill) as a `queue` span.
    pub fn admitted(&self, resumed_after: u32) {
        let tracer = opentelemetry::global::tracer(SCOPE);
        let mut span = tracer
            .span_builder("queue")
            .with_start_time(self.queued_at)
            .with_attributes([KeyValue::new(
                "quiver.resumed_after_tokens",
                i64::from(resumed_after),
            )])
            .start_with_context(&tracer, &self.context);
        opentelemetry::trace::Span::end(&mut span);
    }

    /// A preempted request waits again from now.
    pub fn requeued(&mut self) {
        self.queued_at = SystemTime::now();
    }
}

/// The span of one Prefill or Decode step (or an adapter activation before one).
pub struct StepSpan {
    context: Context,
}

impl StepSpan {
    /// Starts the span of step `name` over the traced requests in `requests` (id, trace); the
    /// request with the lowest id (the oldest) is its parent, the others are links. `None`
    /// when tracing is off or no request in the step is traced.
    pub fn start<'a>(
        name: &'static str,
        attributes: impl FnOnce() -> Vec<KeyValue>,
        requests: impl Iterator<Item = (u64, &'a RequestTrace)>,
    ) -> Option<Self> {
        if !enabled() {
            return None;
        }
        let mut traced: Vec<(u64, &RequestTrace)> = requests.collect();
        traced.sort_unstable_by_key(|(id, _)| *id);
        let ((_, parent), others) = traced.split_first()?;
        let links = others
            .iter()
            .map(|(_, trace)| Link::with_context(trace.context.span().span_context().clone()))
            .collect();
        let tracer = opentelemetry::global::tracer(SCOPE);
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_links(links)
            .with_attributes(attributes())
            .start_with_context(&tracer, &parent.context);
        Some(Self {
            context: parent.context.with_span(span),
        })
    }

    /// Ends the span, marked as an error when the step failed.
    pub fn end(self, error: Option<&dyn std::fmt::Display>) {
        let span = self.context.span();
        if let Some(error) = error {
            span.set_status(Status::error(error.to_string()));
        }
        span.end();
    }
}

/// Runs `call` with `step` as the current context (the shard client reads it for
/// `traceparent`); untouched when there is no step span.
pub async fn within_step<T>(step: Option<&StepSpan>, call: impl Future<Output = T>) -> T {
    match step {
        Some(step) => call.with_context(step.context.clone()).await,
        None => call.await,
    }
}
