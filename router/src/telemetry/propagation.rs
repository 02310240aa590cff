//! W3C Trace Context in and out: the client's `traceparent` (and `tracestate`) header is the
//! parent of the request's span; the current step's context goes to the shards as the same
//! header in gRPC metadata. Parsing and formatting are the OpenTelemetry SDK's propagator's.

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// The parent the client sent; an empty context (the request starts a trace) when it sent
/// none or a malformed one.
pub fn parent_from_headers(headers: &HeaderMap) -> Context {
    let well_formed = headers
        .get(TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .is_some_and(has_w3c_field_sizes);
    if !well_formed {
        return Context::new();
    }
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

const TRACEPARENT: &str = "traceparent";

/// `version-traceid-parentid-flags` with 2, 32, 16 and 2 lowercase hex digits (W3C Trace
/// Context, 3.2.2). The SDK's propagator checks the values but accepts shorter ids, which the
/// recommendation says to ignore; a later version may append fields after a `-`.
fn has_w3c_field_sizes(traceparent: &str) -> bool {
    let mut fields = traceparent.splitn(5, '-');
    let sizes_match = [2, 32, 16, 2].iter().all(|&size| {
        fields.next().is_some_and(|field| {
            field.len() == size
                && field
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    });
    sizes_match && (fields.next().is_none() || !traceparent.starts_with("00-"))
}

/// Adds the current span's `traceparent` to an outgoing shard call; nothing when tracing is
/// off or no span is current.
pub fn inject_current(metadata: &mut MetadataMap) {
    if super::enabled() {
        inject(&Context::current(), metadata);
    }
}

fn inject(context: &Context, metadata: &mut MetadataMap) {
    if context.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(context, &mut MetadataInjector(metadata));
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|name| name.as_str()).collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes only `traceparent`/`tracestate` with ASCII values; anything
        // else is left out rather than failing the call.
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use opentelemetry::trace::{SpanId, TraceId};

    use super::*;

    /// The example of the W3C Trace Context recommendation, section 3.2.
    const W3C_EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(traceparent: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", HeaderValue::from_str(traceparent).unwrap());
        headers
    }

    #[test]
    fn a_client_traceparent_becomes_the_remote_parent() {
        let parent = parent_from_headers(&headers(W3C_EXAMPLE));
        let span = parent.span();
        let context = span.span_context();
        assert!(context.is_valid() && context.is_remote() && context.is_sampled());
        assert_eq!(
            context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(
            context.span_id(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
    }

    #[test]
    fn no_or_malformed_traceparent_starts_a_new_trace() {
        assert!(!parent_from_headers(&HeaderMap::new()).has_active_span());
        for malformed in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01", // all-zero trace id
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // all-zero span id
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", // forbidden version
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  // short trace id
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",  // short span id
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", // upper case
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", // extra in v00
            "not a traceparent",
        ] {
            let parent = parent_from_headers(&headers(malformed));
            assert!(!parent.span().span_context().is_valid(), "{malformed}");
        }
    }

    #[test]
    fn a_later_version_may_carry_more_fields() {
        let header =
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        let parent = parent_from_headers(&headers(header));
        assert_eq!(
            parent.span().span_context().trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
    }

    #[test]
    fn the_context_goes_to_the_shard_as_the_same_traceparent() {
        let parent = parent_from_headers(&headers(W3C_EXAMPLE));
        let mut metadata = MetadataMap::new();
        inject(&parent, &mut metadata);
        assert_eq!(metadata.get("traceparent").unwrap(), W3C_EXAMPLE);
    }

    #[test]
    fn nothing_is_sent_without_a_span() {
        let mut metadata = MetadataMap::new();
        inject(&Context::new(), &mut metadata);
        assert!(metadata.is_empty());
        // Tracing is off in this process (nothing called `init`): the hook sends nothing.
        inject_current(&mut metadata);
        assert!(metadata.is_empty());
    }
}
