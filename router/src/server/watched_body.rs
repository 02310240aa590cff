//! One wrapper for every body that must do something besides passing its frames along: keep a
//! request in progress until its last frame (`activity`), count what a response sent
//! (`http::give_back`), hold a tenant's place (`http::held_body`), discard the unread rest of a
//! request (`http::body_guard`). Frames, end and size pass through unchanged, so a JSON answer
//! keeps its `Content-Length`; each watcher says only what it does with them.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use http_body::{Frame, SizeHint};

/// One poll's outcome, as a watcher sees it.
pub type Polled = Poll<Option<Result<Frame<Bytes>, axum::Error>>>;

/// What a `WatchedBody` does around its inner body.
pub trait BodyWatch: Send + Unpin + 'static {
    /// Sees each poll's outcome before the caller does.
    fn polled(&mut self, _polled: &Polled) {}

    /// The body is dropped; `rest` is what was not read of it (none once it ended).
    fn dropped(&mut self, rest: Option<Body>) {
        drop(rest);
    }
}

pub struct WatchedBody<W: BodyWatch> {
    inner: Option<Body>,
    watch: W,
}

impl<W: BodyWatch> WatchedBody<W> {
    pub fn wrap(inner: Body, watch: W) -> Body {
        Body::new(Self {
            inner: Some(inner),
            watch,
        })
    }
}

impl<W: BodyWatch> HttpBody for WatchedBody<W> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            // Ended: nothing is left for `dropped` to see.
            self.inner = None;
        }
        self.watch.polled(&polled);
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

impl<W: BodyWatch> Drop for WatchedBody<W> {
    fn drop(&mut self) {
        let rest = self.inner.take();
        self.watch.dropped(rest);
    }
}
