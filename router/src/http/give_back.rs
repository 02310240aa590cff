//! Memory given back after a large request body. glibc's malloc keeps what a request freed in
//! its per-thread arenas: four refused 4 MB bodies once left the router holding 740 MB. Parsing
//! is bounded now (`bounded_json`), but a body of a few MB still becomes tens of MB of parsed
//! JSON, freed when the handler is done and then held. After a request whose body was larger
//! than `LARGE_BODY_BYTES`, `malloc_trim` hands the free pages of every arena back to the
//! system before the response goes out (about a millisecond on the router's small heap; a body
//! that large is a prompt of tens of thousands of tokens, whose prefill takes far longer).

use axum::extract::Request;
use axum::http::header::CONTENT_LENGTH;
use axum::middleware::Next;
use axum::response::Response;

pub const LARGE_BODY_BYTES: u64 = 256 << 10;

pub async fn trim_after_large_bodies(request: Request, next: Next) -> Response {
    let large = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|length| length.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|length| length > LARGE_BODY_BYTES);
    let response = next.run(request).await;
    if large {
        // Off the async workers: trimming walks every arena.
        let _ = tokio::task::spawn_blocking(trim).await;
    }
    response
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
