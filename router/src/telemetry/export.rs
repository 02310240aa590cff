//! The exporter: an OTLP/gRPC span exporter behind the SDK's batch processor, and the
//! `tracing` layer that turns the router's request spans into OpenTelemetry spans.

use std::sync::atomic::Ordering;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The instrumentation scope the router's spans are reported under.
const SCOPE: &str = "quiver-router";

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP exporter for {endpoint}: {message}")]
    Exporter { endpoint: String, message: String },
}

/// The running exporter; [`Exporter::shutdown`] flushes the spans still buffered.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Sends what is buffered and stops the exporter's thread (at exit, so the last requests'
    /// spans are not lost).
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "tracing exporter did not shut down cleanly");
        }
    }
}

/// Starts exporting to `endpoint` (must run inside the tokio runtime: the gRPC client lives
/// there) and returns the layer to add to the subscriber. Only the router's own spans go to the
/// exporter, whatever `RUST_LOG` says about log lines.
pub fn init<S>(
    endpoint: &str,
    service_name: &str,
) -> Result<(Exporter, impl Layer<S> + Send + Sync), TelemetryError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|error| TelemetryError::Exporter {
            endpoint: endpoint.to_owned(),
            message: error.to_string(),
        })?;
    let resource = Resource::builder()
        .with_service_name(service_name.to_owned())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    // The scheduler's step spans are made with the OpenTelemetry API through the global provider.
    opentelemetry::global::set_tracer_provider(provider.clone());
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target("quiver_router", LevelFilter::INFO));
    super::ENABLED.store(true, Ordering::Relaxed);
    Ok((Exporter { provider }, layer))
}
