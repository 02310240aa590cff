//! HTTP responses by endpoint (the route template, so ids in paths add no series), status and
//! error code (`none` for successes). Counted once per response, under a short lock.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::text;

/// The error code of a response, put in its extensions by `ApiError` so the counting
/// middleware need not parse the body.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

/// The endpoint label of requests that matched no route.
pub const UNMATCHED: &str = "unmatched";

#[derive(Debug, Default)]
pub struct HttpMetrics {
    responses: Mutex<BTreeMap<(String, u16, &'static str), u64>>,
}

impl HttpMetrics {
    pub fn count(&self, endpoint: &str, status: u16, code: Option<ErrorCode>) {
        let code = code.map_or("none", |ErrorCode(code)| code);
        let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *responses
            .entry((endpoint.to_owned(), status, code))
            .or_default() += 1;
    }

    pub fn render(&self, out: &mut String) {
        let name = "quiver_http_requests_total";
        text::header(
            out,
            name,
            "counter",
            "HTTP responses by endpoint (route template), status and error code (none on success).",
        );
        let responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        for ((endpoint, status, code), count) in responses.iter() {
            let status = status.to_string();
            let labels = [
                ("endpoint", endpoint.as_str()),
                ("status", &status),
                ("code", code),
            ];
            text::sample(out, name, &labels, count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_counted_per_endpoint_status_and_code() {
        let metrics = HttpMetrics::default();
        metrics.count("/v1/completions", 200, None);
        metrics.count("/v1/completions", 200, None);
        metrics.count("/v1/completions", 400, Some(ErrorCode("invalid_value")));
        let mut out = String::new();
        metrics.render(&mut out);
        assert!(out.contains(
            "quiver_http_requests_total{endpoint=\"/v1/completions\",status=\"200\",code=\"none\"} 2\n"
        ));
        assert!(out.contains(
            "quiver_http_requests_total{endpoint=\"/v1/completions\",status=\"400\",code=\"invalid_value\"} 1\n"
        ));
    }
}
