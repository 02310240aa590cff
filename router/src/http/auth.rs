//! Authentication and per-key admission. With `--api-key` or `--api-keys-file`, `/v1/*`,
//! `/tokenize` and `/detokenize` need `Authorization: Bearer <key>`, and `/metrics` an admin key
//! (it names every adapter and key) unless `--metrics-open`; the probes (`/health`, `/info`)
//! stay open. The request carries its [`Caller`] on to the handlers, which check the models it
//! names; the key's place under its concurrency limit is held until the response body has been
//! sent (a stream included) or dropped.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;

use super::held_body::hold_until_sent;
use super::state::AppState;
use crate::error::ApiError;
use crate::tenants::Caller;

pub async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let caller = state
        .tenants
        .authenticate(bearer(&request))
        .ok_or(ApiError::Unauthorized)?;
    let in_flight = caller
        .admit(Instant::now())
        .map_err(|refused| ApiError::KeyLimit {
            key: caller.name().unwrap_or_default().to_owned(),
            refused,
        })?;
    request.extensions_mut().insert(caller);
    let response = next.run(request).await;
    let Some(in_flight) = in_flight else {
        return Ok(response);
    };
    Ok(hold_until_sent(response, in_flight))
}

/// Loading and unloading adapters: admin keys only (403 for the others, who are known).
pub async fn require_admin(
    caller: axum::Extension<Caller>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if !caller.is_admin() {
        return Err(ApiError::PermissionDenied(
            "this API key may not load or unload adapters".to_owned(),
        ));
    }
    Ok(next.run(request).await)
}

/// `/metrics`: 401 without a known key, 403 for a key that is not an admin's, unless
/// `--metrics-open` (or no keys are configured). A scrape is authenticated, not admitted: it
/// takes no place under the key's own limits and is not counted as its request.
pub async fn guard_metrics(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if !state.metrics_open {
        let caller = state
            .tenants
            .authenticate(bearer(&request))
            .ok_or(ApiError::Unauthorized)?;
        if !caller.is_admin() {
            return Err(ApiError::PermissionDenied(
                "this API key may not read /metrics (it names every adapter and key): use an \
                 admin key, or serve it with --metrics-open where only the scrapers can reach it"
                    .to_owned(),
            ));
        }
    }
    Ok(next.run(request).await)
}

fn bearer(request: &Request) -> Option<&str> {
    request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
}
