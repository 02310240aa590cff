//! A response body that keeps something alive until the body is dropped (sent to the end or
//! abandoned by the client): a tenant's in-flight place, a request's trace span. Frames, end
//! and size pass through unchanged, so a JSON answer keeps its `Content-Length`.

use axum::response::Response;

use crate::server::{BodyWatch, WatchedBody};

/// Holds its value; the body drops it when it is itself dropped.
struct Held<T> {
    _value: T,
}

impl<T: Send + Unpin + 'static> BodyWatch for Held<T> {}

/// `response` with a body that drops `held` only when it is itself dropped.
pub fn hold_until_sent<T: Send + Unpin + 'static>(response: Response, held: T) -> Response {
    response.map(|inner| WatchedBody::wrap(inner, Held { _value: held }))
}
