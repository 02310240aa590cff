//! `quiver-router`: connect to the shards, size the KV cache, load the tokenizer and chat
//! template, serve the OpenAI API, and drain gracefully on SIGTERM/SIGINT; SIGHUP reloads
//! `--api-keys-file`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use quiver_router::config::RouterArgs;
use quiver_router::files::ConfinedDir;
use quiver_router::http;
use quiver_router::scheduler::Scheduler;
use quiver_router::server::{BodyLimits, ConnectionLimits, IdleLimits, Server};
use quiver_router::shard::{ShardBackend, ShardClient, ShardError};
use quiver_router::startup::{self, Settings};
use quiver_router::telemetry;
use quiver_router::template::ChatTemplate;
use quiver_router::tenants;
use quiver_router::tokenizer::TextTokenizer;
use quiver_router::validation::ModelAssets;
use tokio::net::TcpListener;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How long to keep trying to reach the shards (the launcher starts us once they answer
/// Health, so this only covers a slow socket).
const CONNECT_ATTEMPTS: u32 = 60;
const CONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// Exit code after a shutdown whose grace period ran out with requests still running (1 is
/// a failure to start or serve).
const EXIT_CUT_REQUESTS: u8 = 3;
/// After the cutoff, how long the cut requests' error events and bodies get to be sent.
const CUT_FLUSH_TIME: Duration = Duration::from_secs(2);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let args = RouterArgs::parse();
    let exporter = match init_tracing(&args) {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("quiver-router failed: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = match run(args).await {
        Ok(Stopped::Clean) => ExitCode::SUCCESS,
        Ok(Stopped::CutRequests) => ExitCode::from(EXIT_CUT_REQUESTS),
        Err(error) => {
            tracing::error!("quiver-router failed: {error}");
            ExitCode::FAILURE
        }
    };
    if let Some(exporter) = exporter {
        exporter.shutdown();
    }
    code
}

async fn run(args: RouterArgs) -> Result<Stopped, BoxError> {
    let hangups =
        tenants::catch_sighup().map_err(|error| format!("cannot listen for SIGHUP: {error}"))?;
    let shard: Arc<dyn ShardBackend> = Arc::new(connect(&args.shard_uds).await?);
    let info = shard
        .info()
        .await
        .map_err(|error| format!("shard Info failed: {error}"))?;
    tracing::info!(
        model_id = %info.model_id,
        model_type = %info.model_type,
        dtype = %info.dtype,
        device = %info.device,
        world_size = info.world_size,
        "connected to the shards"
    );
    let assets = load_assets(Path::new(&info.model_path))?;
    let state = startup::start(shard, info, assets, Settings::from_args(&args)).await?;
    tenants::reload_on_sighup(hangups, state.tenants.clone());
    tracing::info!(limits = ?state.info.limits, "KV cache sized");
    tracing::info!(
        source = %args.serving.adapter_source,
        root = ?args.serving.adapter_root,
        max_active_adapters = args.serving.max_active_adapters,
        max_lora_rank = args.serving.max_lora_rank,
        lora_rank_classes = ?args.serving.lora_rank_classes.as_ref().map(ToString::to_string),
        preloaded = ?state.infer.models().adapters().list().iter().map(|entry| entry.id.as_str()).collect::<Vec<_>>(),
        "adapters"
    );

    let listener = TcpListener::bind((args.serving.hostname.as_str(), args.serving.port))
        .await
        .map_err(|error| {
            format!(
                "cannot listen on {}:{}: {error}",
                args.serving.hostname, args.serving.port
            )
        })?;
    tracing::info!(
        "router ready on http://{}:{}",
        args.serving.hostname,
        listener.local_addr()?.port()
    );

    let app = http::limit_bodies(
        http::router(state.clone()),
        args.serving.max_request_body_bytes,
    );
    let server = Server::spawn(listener, app, connection_limits(&args));
    shutdown_signal().await;
    tracing::info!("shutdown requested: no new requests, draining those in flight");
    state.infer.scheduler().shutdown();
    server.stop_accepting();
    let grace = Duration::from_secs(args.serving.graceful_shutdown_secs);
    if tokio::time::timeout(grace, server.closed()).await.is_err() {
        tracing::warn!(
            in_flight = state.infer.scheduler().in_flight(),
            "grace period of {}s over; ending the requests still in flight with an error",
            grace.as_secs()
        );
        state.infer.cutoff().fire();
        // The cut requests answer at once; this only bounds how long their last bytes take.
        let _ = tokio::time::timeout(CUT_FLUSH_TIME, server.closed()).await;
    }
    drain_scheduler(state.infer.scheduler()).await;
    let cut = state.infer.cutoff().cut_requests();
    if cut > 0 {
        tracing::warn!(
            cut,
            "router stopped; requests were cut at the end of the grace period"
        );
        return Ok(Stopped::CutRequests);
    }
    tracing::info!("router stopped");
    Ok(Stopped::Clean)
}

/// How the router ended after a shutdown signal.
enum Stopped {
    /// Every request finished within the grace period.
    Clean,
    /// Some were ended with an error when it ran out.
    CutRequests,
}

fn connection_limits(args: &RouterArgs) -> ConnectionLimits {
    ConnectionLimits {
        idle: IdleLimits {
            header_read: Duration::from_secs(args.serving.header_read_timeout_secs),
            keep_alive: Duration::from_secs(args.serving.keep_alive_timeout_secs),
        },
        body: BodyLimits {
            read_timeout: Duration::from_secs(args.serving.body_read_timeout_secs),
            min_rate: args.serving.body_read_min_rate,
        },
        max_connections: args.serving.max_connections,
    }
}

/// Connections are closed; give the scheduler a moment to release what it still holds.
async fn drain_scheduler(scheduler: &Scheduler) {
    for _ in 0..20 {
        if scheduler.in_flight() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn connect(paths: &[PathBuf]) -> Result<ShardClient, ShardError> {
    let mut attempt = 1;
    loop {
        match ShardClient::connect(paths).await {
            Ok(client) => return Ok(client),
            Err(error) if attempt < CONNECT_ATTEMPTS => {
                tracing::debug!(%error, attempt, "shard not reachable yet");
                attempt += 1;
                tokio::time::sleep(CONNECT_BACKOFF).await;
            }
            Err(error) => return Err(error),
        }
    }
}

fn load_assets(model_path: &Path) -> Result<ModelAssets, BoxError> {
    // Start-up errors go to the operator's log, so they may name the directory.
    let in_model = |error: &dyn std::fmt::Display| format!("{}: {error}", model_path.display());
    let dir = ConfinedDir::model_dir(model_path).map_err(|error| in_model(&error))?;
    let tokenizer = TextTokenizer::from_dir(&dir).map_err(|error| in_model(&error))?;
    let template = ChatTemplate::from_dir(&dir).map_err(|error| in_model(&error))?;
    if template.is_none() {
        tracing::warn!(path = %model_path.display(), "the model has no chat template: /v1/chat/completions will answer 400");
    }
    Ok(ModelAssets {
        tokenizer,
        template,
        adapters_own_template: false,
    })
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(signal) => signal,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the router");
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

/// Human-readable logs, or one JSON object per line (`{"timestamp","level","message","target",
/// ...fields}`) on stderr for the launcher and log collectors. `RUST_LOG` overrides the level.
/// With `--otlp-endpoint`, spans also go to the OTLP exporter (whatever `RUST_LOG` says).
fn init_tracing(args: &RouterArgs) -> Result<Option<telemetry::Exporter>, BoxError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = if args.json_logs {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed()
    };
    let (exporter, spans) = match &args.serving.otlp_endpoint {
        Some(endpoint) => {
            let (exporter, layer) = telemetry::init(endpoint, &args.serving.otel_service_name)?;
            (Some(exporter), Some(layer))
        }
        None => (None, None),
    };
    tracing_subscriber::registry().with(logs).with(spans).init();
    if let Some(endpoint) = &args.serving.otlp_endpoint {
        tracing::info!(
            endpoint,
            service_name = %args.serving.otel_service_name,
            "exporting traces over OTLP/gRPC"
        );
    }
    Ok(exporter)
}
