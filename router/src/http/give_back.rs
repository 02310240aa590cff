//! Memory given back after a large request body or a large response. glibc's malloc keeps what
//! a request freed in its per-thread arenas: four refused 4 MB bodies once left the router
//! holding 740 MB. Parsing is bounded now (`bounded_json`), but a body of a few MB still becomes
//! tens of MB of parsed JSON, freed when the handler is done and then held; and a response with
//! a quarter of a million logprob entries (`--max-logprob-entries`) builds about 35 MB of
//! entries and text, freed only once its last byte is sent. After a request whose body was
//! larger than `LARGE_BODY_BYTES`, or whose JSON answer is larger than `LARGE_RESPONSE_BYTES`,
//! `malloc_trim` hands the free pages of every arena back to the system before the response goes
//! out (what built the answer is freed by then); and after any answer that sent more than that
//! (the JSON text itself, or a whole stream), once its body is dropped. Each trim takes about a
//! millisecond on the router's small heap, on a blocking worker; an exchange that large takes
//! far longer.

use std::task::Poll;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::header::CONTENT_LENGTH;
use axum::middleware::Next;
use axum::response::Response;

use crate::server::{BodyWatch, Polled, WatchedBody};

pub const LARGE_BODY_BYTES: u64 = 256 << 10;
pub const LARGE_RESPONSE_BYTES: u64 = 1 << 20;

pub async fn trim_after_large_bodies(request: Request, next: Next) -> Response {
    let large = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|length| length.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|length| length > LARGE_BODY_BYTES);
    let response = next.run(request).await;
    let answer = response.body().size_hint().exact();
    if large || answer.is_some_and(|length| length > LARGE_RESPONSE_BYTES) {
        // Off the async workers: trimming walks every arena.
        let _ = tokio::task::spawn_blocking(trim).await;
    }
    response.map(|inner| WatchedBody::wrap(inner, SentBytes(0)))
}

/// Counts what a response sent, and trims once it is dropped if that was more than
/// `LARGE_RESPONSE_BYTES`.
struct SentBytes(u64);

impl BodyWatch for SentBytes {
    fn polled(&mut self, polled: &Polled) {
        if let Poll::Ready(Some(Ok(frame))) = polled {
            if let Some(data) = frame.data_ref() {
                self.0 += data.len() as u64;
            }
        }
    }

    fn dropped(&mut self, rest: Option<Body>) {
        // What the response held goes first, so that the trim finds it free.
        drop(rest);
        if self.0 <= LARGE_RESPONSE_BYTES {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn_blocking(trim);
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only returns free memory to the system; it is safe to call from any
    // thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}
