//! The request fields a body sent that its endpoint's table does not know: accepted without
//! effect (DESIGN.md: real clients send extras), but never silently: logged, and named in the
//! response's `quiver-ignored-fields` header, so that a misspelt `max_token` shows.

use axum::http::HeaderValue;
use axum::response::Response;

use crate::openai::fields::IGNORED_FIELDS_HEADER;

/// `response` with `ignored` named in its header (when there are any).
pub fn name_ignored_fields(mut response: Response, ignored: &[String]) -> Response {
    if ignored.is_empty() {
        return response;
    }
    tracing::warn!(fields = ?ignored, "request fields accepted without effect (unknown)");
    // Field names are JSON object keys; one that is not a valid header value is left out of
    // the header (it is still logged).
    if let Ok(value) = HeaderValue::from_str(&ignored.join(", ")) {
        response.headers_mut().insert(IGNORED_FIELDS_HEADER, value);
    }
    response
}
