//! Request bodies a handler did not read to the end: an early 401, a 413 after the first
//! `--max-request-body-bytes`, a 404 on a POST. The rest of such a body is still on its way,
//! and closing the connection under it makes the client see a reset instead of our answer. So
//! the rest is read and thrown away in the background (bounded in bytes and time) and the
//! connection stays usable; a rest that is too large or of unknown length gets
//! `Connection: close` on the response, and is read only as far as the bound allows.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;

use crate::server::{BodyWatch, WatchedBody};

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
        WatchedBody::wrap(
            body,
            DiscardRest {
                bound: bound.0,
                close: close.clone(),
            },
        )
    });
    let mut response = next.run(request).await;
    if close.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Has the rest of a request body that is dropped before its end discarded.
struct DiscardRest {
    bound: u64,
    /// Set when the rest is too large (or of unknown size) to promise keep-alive.
    close: Arc<AtomicBool>,
}

impl BodyWatch for DiscardRest {
    fn dropped(&mut self, rest: Option<Body>) {
        let Some(rest) = rest else {
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
