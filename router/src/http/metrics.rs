//! `GET /metrics`: Prometheus text. Load gauges are read from the scheduler at scrape time;
//! token and request counters are counted where a request's life ends, in `generation`.

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::state::AppState;
use crate::metrics::http::{ErrorCode, UNMATCHED};
use crate::metrics::Metrics;

/// The route template of a matched request, carried to `count_responses` on the response.
#[derive(Clone)]
struct Route(MatchedPath);

/// Inside routing: tags the response with the route it matched.
pub async fn tag_route(request: Request, next: Next) -> Response {
    let route = request.extensions().get::<MatchedPath>().cloned();
    let mut response = next.run(request).await;
    if let Some(route) = route {
        response.extensions_mut().insert(Route(route));
    }
    response
}

/// Outside routing: counts every response by route, status and error code.
pub async fn count_responses(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    let endpoint = response
        .extensions()
        .get::<Route>()
        .map_or(UNMATCHED, |Route(path)| path.as_str());
    let code = response.extensions().get::<ErrorCode>().copied();
    state
        .metrics
        .http
        .count(endpoint, response.status().as_u16(), code);
    response
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let stats = state.scheduler.stats();
    let metrics = &state.metrics;
    Metrics::set(&metrics.kv_blocks_total, u64::from(stats.total_blocks));
    let block_size = state.scheduler.config().block_size;
    Metrics::set(&metrics.kv_block_size, u64::from(block_size));
    Metrics::set(&metrics.kv_blocks_free, u64::from(stats.free_blocks));
    Metrics::set(&metrics.requests_running, stats.running as u64);
    Metrics::set(&metrics.requests_waiting, stats.queued as u64);
    Metrics::set(&metrics.adapters_active, stats.active_adapters as u64);
    Metrics::set(&metrics.adapter_slots, u64::from(stats.adapter_slots));
    Metrics::set(&metrics.prefill_steps_total, stats.prefill_steps);
    Metrics::set(&metrics.decode_steps_total, stats.decode_steps);
    Metrics::set(&metrics.preemptions_total, stats.preemptions);
    Metrics::set(
        &metrics.prefix_cache_queries_total,
        stats.prefix_cache_queries,
    );
    Metrics::set(&metrics.prefix_cache_hits_total, stats.prefix_cache_hits);
    Metrics::set(&metrics.grammar_mask_steps, stats.grammar_steps);
    Metrics::set(&metrics.grammar_mask_ns, stats.grammar_ns);
    let mut page = metrics.render();
    state.tenants.render_metrics(&mut page);
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        page,
    )
}
