//! Authentication and per-key admission. With `--api-key` or `--api-keys-file`, `/v1/*`,
//! `/tokenize` and `/detokenize` need `Authorization: Bearer <key>`; probes (`/health`,
//! `/info`, `/metrics`) stay open. The request carries its [`Caller`] on to the handlers, which
//! check the models it names; the key's place under its concurrency limit is held until the
//! response body has been sent (a stream included) or dropped.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

use super::state::AppState;
use crate::error::ApiError;
use crate::tenants::{Caller, InFlight};

pub async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let authorization = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    let caller = state
        .tenants
        .authenticate(authorization)
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
    Ok(response.map(|body| {
        Body::new(HeldBody {
            inner: body,
            _in_flight: in_flight,
        })
    }))
}

/// A response body that holds the key's place until it is dropped; frames, end and size pass
/// through unchanged (a JSON answer keeps its `Content-Length`).
struct HeldBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
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
