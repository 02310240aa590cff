//! The server span of each HTTP request: named `METHOD /route`, parented on the client's
//! `traceparent`, and open until the response body is sent (a stream lasts as long as its
//! generation).

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use tracing::field::Empty;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::{enabled, parent_from_headers};
use crate::http::held_body::hold_until_sent;

/// Probes and scrapes, every few seconds from Kubernetes and Prometheus: traced, they would
/// bury the requests' traces.
const UNTRACED_ROUTES: [&str; 2] = ["/health", "/metrics"];

/// axum middleware: traces the request when tracing is on, passes it straight through when off.
pub async fn trace_requests(request: Request, next: Next) -> Response {
    if !enabled() {
        return next.run(request).await;
    }
    // The route template, never the raw path: adapter ids and unknown paths stay out of names.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_owned());
    if route
        .as_deref()
        .is_some_and(|route| UNTRACED_ROUTES.contains(&route))
    {
        return next.run(request).await;
    }
    let method = request.method().clone();
    let name = match &route {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    let span = tracing::info_span!(
        target: "quiver_router::telemetry",
        "quiver",
        otel.name = %name,
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %method,
        http.route = route.as_deref().unwrap_or(""),
        http.response.status_code = Empty,
    );
    // A malformed `traceparent` is no error: the request starts a trace of its own.
    let _ = span.set_parent(parent_from_headers(request.headers()));
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
    hold_until_sent(response, span)
}
