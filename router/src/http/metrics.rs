//! `GET /metrics`: Prometheus text. Load gauges are read from the scheduler at scrape time;
//! token and request counters are counted where a request's life ends, in `generation`.

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;

use super::state::AppState;
use crate::metrics::Metrics;

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let stats = state.scheduler.stats();
    let metrics = &state.metrics;
    Metrics::set(&metrics.kv_blocks_total, u64::from(stats.total_blocks));
    Metrics::set(&metrics.kv_blocks_free, u64::from(stats.free_blocks));
    Metrics::set(&metrics.requests_running, stats.running as u64);
    Metrics::set(&metrics.requests_waiting, stats.queued as u64);
    Metrics::set(&metrics.adapters_active, stats.active_adapters as u64);
    Metrics::set(&metrics.adapter_slots, u64::from(stats.adapter_slots));
    Metrics::set(&metrics.prefill_steps_total, stats.prefill_steps);
    Metrics::set(&metrics.decode_steps_total, stats.decode_steps);
    Metrics::set(&metrics.preemptions_total, stats.preemptions);
    Metrics::set(&metrics.grammar_mask_steps, stats.grammar_steps);
    Metrics::set(&metrics.grammar_mask_ns, stats.grammar_ns);
    let mut page = metrics.render();
    state.tenants.render_metrics(&mut page);
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        page,
    )
}
