//! quiver-launcher: starts the shards and the router, and supervises them (see supervisor.rs).

mod args;
mod child_logs;
mod commands;
mod demo;
mod error;
mod health;
mod process;
mod signals;
mod socket_dir;
mod supervisor;

/// The shard service's gRPC client, generated from proto/ by build.rs.
mod pb {
    tonic::include_proto!("quiver.v1");
}

use std::io::IsTerminal;

use crate::args::LauncherArgs;

fn main() -> std::process::ExitCode {
    let args = LauncherArgs::from_env();
    init_logging(args.json_logs);
    // One thread is plenty for a supervisor, and it matters: the children's parent-death
    // signal fires when the *thread* that spawned them exits, and this one lives until the end.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!("could not start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(supervisor::run(args));
    // Dropping the runtime before exiting lets every child guard run.
    drop(runtime);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("quiver-launcher stopped: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Human-readable lines by default, JSON lines with --json-logs; RUST_LOG filters (default info).
fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}
