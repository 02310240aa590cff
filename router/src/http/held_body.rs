//! A response body that keeps something alive until the body is dropped (sent to the end or
//! abandoned by the client): a tenant's in-flight place, a request's trace span. Frames, end
//! and size pass through unchanged, so a JSON answer keeps its `Content-Length`.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::response::Response;
use http_body::{Frame, SizeHint};

struct HeldBody<T> {
    inner: Body,
    _held: T,
}

/// `response` with a body that drops `held` only when it is itself dropped.
pub fn hold_until_sent<T: Send + Unpin + 'static>(response: Response, held: T) -> Response {
    response.map(|inner| Body::new(HeldBody { inner, _held: held }))
}

impl<T: Unpin> HttpBody for HeldBody<T> {
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
