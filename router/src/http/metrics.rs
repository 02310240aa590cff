//! `GET /metrics`: Prometheus text. Load gauges are read from the scheduler at scrape time;
//! token and request counters
//! are counted where a request's life ends (`Infer::metrics_page`).

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::state::AppState;
use crate::metrics::http::{ErrorCode, UNMATCHED};

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
        .infer
        .metrics()
        .http
        .count(endpoint, response.status().as_u16(), code);
    response
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut page = state.infer.metrics_page();
    state.tenants.render_metrics(&mut page);
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        page,
    )
}
