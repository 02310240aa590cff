//! Request bodies a handler did not read to the end: an early 401, a 413 after the first
//! `--max-request-body-bytes`, a 404 on a POST. The rest of such a body is still on its way,
//! and closing the connection under it makes the client see a reset instead of our answer. So
//! the rest is read and thrown away in the background (bounded in bytes and time) and the
//! connection stays usable; a rest that is too large or of unknown length gets
//! `Connection: close` on the response, and is read only as far as the bound allows.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use http_body::{Frame, SizeHint};

/// How long the unread rest of a body may take to arrive before the connection is dropped.
const DISCARD_TIME: Duration = Duration::from_secs(10);

/// Applies the body limit (`OpenAiJson` answers 413 beyond it) and the discarding of unread
/// bodies to every route of `app`. Up to `max_body_bytes` more are discarded: a client that
/// overshoots the limit by as much again still reads its 413 on a live connection.
pub fn limit_bodies(app: Router, max_body_bytes: usize) -> Router {
    app.layer(middleware::from_fn(
        super::give_back::trim_after_large_bodies,
    ))
    .layer(middleware::from_fn_with_state(
        DiscardBound(max_body_bytes as u64),
        discard_unread,
    ))
    .layer(DefaultBodyLimit::max(max_body_bytes))
}

#[derive(Clone, Copy)]
struct DiscardBound(u64);

async fn discard_unread(
    State(bound): State<DiscardBound>,
    request: Request,
    next: Next,
) -> Response {
    let close = Arc::new(AtomicBool::new(false));
    let request = request.map(|body| {
        Body::new(DiscardOnDrop {
            inner: Some(body),
            bound: bound.0,
            close: close.clone(),
        })
    });
    let mut response = next.run(request).await;
    if close.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that, dropped before its end, has its rest discarded.
struct DiscardOnDrop {
    inner: Option<Body>,
    bound: u64,
    /// Set when the rest is too large (or of unknown size) to promise keep-alive.
    close: Arc<AtomicBool>,
}

impl HttpBody for DiscardOnDrop {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            self.inner = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for DiscardOnDrop {
    fn drop(&mut self) {
        let Some(rest) = self.inner.take() else {
            return;
        };
        if rest.is_end_stream() {
            return;
        }
        let remaining = rest.size_hint().exact();
        if remaining.is_none_or(|remaining| remaining > self.bound) {
            self.close.store(true, Ordering::Release);
        }
        if remaining.is_some_and(|remaining| remaining > self.bound) {
            // Dropping it makes hyper close the connection after the response.
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(discard(rest, self.bound));
        }
    }
}

/// Reads and forgets up to `bound` bytes of `body`.
async fn discard(mut body: Body, bound: u64) {
    let read = async {
        let mut seen = 0u64;
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
            let Ok(frame) = frame else { return };
            if let Some(data) = frame.data_ref() {
                seen += data.len() as u64;
                if seen > bound {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DISCARD_TIME, read).await;
}
