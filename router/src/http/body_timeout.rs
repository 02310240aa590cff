//! The answer to a request whose body did not arrive in time (`server::BodyDeadline`): 408 in
//! OpenAI's shape with `Connection: close`, in place of whatever the handler made of the cut
//! body (its extractor saw a read error). Inside the response counter, so `/metrics` counts the
//! 408 under the route it came to.

use axum::extract::Request;
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::server::{BodyDeadline, BodyLimits, MIN_RATE_GRACE};

pub async fn answer_late_bodies(request: Request, next: Next) -> Response {
    let deadline = request.extensions().get::<BodyDeadline>().cloned();
    let response = next.run(request).await;
    match deadline {
        Some(deadline) if deadline.passed() => {
            let (mut parts, _) = response.into_parts();
            let (timeout, body) = request_timeout(deadline.limits).into_parts();
            parts.status = timeout.status;
            parts.headers = timeout.headers;
            // The route tag stays; the error code is the timeout's.
            parts.extensions.extend(timeout.extensions);
            Response::from_parts(parts, body)
        }
        _ => response,
    }
}

fn request_timeout(limits: BodyLimits) -> Response {
    let pace = match limits.min_rate {
        0 => String::new(),
        rate => format!(
            ", and after the first {} s at least {rate} bytes per second \
             (--body-read-min-rate)",
            MIN_RATE_GRACE.as_secs()
        ),
    };
    let mut response = ApiError::BodyTimeout(format!(
        "the request body did not arrive in time: this server reads a whole body within {} s \
         of its headers (--body-read-timeout-secs){pace}",
        limits.read_timeout.as_secs()
    ))
    .into_response();
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}
