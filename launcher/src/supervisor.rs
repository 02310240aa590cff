//! The launcher's life: shards up, wait for Health, router up, then watch. A signal drains the
//! router and stops the shards in that order; any child's death stops everything with an error.
//! SIGHUP is passed on to the router, which reloads its API keys file.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use crate::args::{resolve_binary, LauncherArgs, ModelSource};
use crate::commands::{router_command, shard_command, shard_socket, Rendezvous};
use crate::demo::{ensure_demo_model, serve_demo_adapters, DEMO_ADAPTERS};
use crate::error::LaunchError;
use crate::health::wait_until_ready;
use crate::process::{kill_all, terminate_all, ChildProcess};
use crate::signals::{Hangups, ShutdownSignals};
use crate::socket_dir::SocketDir;
use nix::sys::signal::Signal;

/// Time the router gets beyond the grace period to finish its own shutdown.
const ROUTER_EXTRA_STOP_TIME: Duration = Duration::from_secs(5);
/// Time the shards get to exit after SIGTERM (they hold no client state by then).
const SHARD_STOP_TIME: Duration = Duration::from_secs(10);

/// Runs quiver until a signal (Ok after a clean stop) or a failure.
pub async fn run(args: LauncherArgs) -> Result<(), LaunchError> {
    let mut signals = ShutdownSignals::install().map_err(|source| LaunchError::Io {
        what: "install signal handlers".into(),
        source,
    })?;
    let mut hangups = Hangups::install().map_err(|source| LaunchError::Io {
        what: "install signal handlers".into(),
        source,
    })?;
    let server_bin = resolve_binary(args.server_bin.as_deref(), "quiver-server");
    let router_bin = resolve_binary(args.router_bin.as_deref(), "quiver-router");
    let mut args = args;
    let model = match args.requested_model_id() {
        Some(id) => ModelSource::User(id),
        None => {
            let cache_dir = args.cache_dir().ok_or(LaunchError::NoCacheDir)?;
            match ensure_demo_model(&server_bin, &cache_dir, &mut signals).await? {
                Some(dir) => {
                    tracing::info!(
                        "no --model-id given: serving the demo model from {} \
                         (SmolLM2-135M-Instruct, Q4_1 weights dequantized)",
                        dir.display()
                    );
                    if serve_demo_adapters(&mut args, &dir) {
                        tracing::info!(
                            "serving the demo adapters too: {}",
                            DEMO_ADAPTERS.join(", ")
                        );
                    } else {
                        tracing::info!(
                            "--adapter-root or --adapter-source given: the demo adapters are not \
                             served"
                        );
                    }
                    ModelSource::Demo { dir }
                }
                None => return Ok(()),
            }
        }
    };
    let socket_dir = SocketDir::create().map_err(|source| LaunchError::Io {
        what: "create the shards' socket directory".into(),
        source,
    })?;
    let plan = Plan {
        sockets: (0..args.num_shard)
            .map(|rank| shard_socket(socket_dir.path(), rank))
            .collect(),
        args,
        model,
        server_bin,
        router_bin,
    };
    let mut stack = Stack::default();
    let result = start_and_watch(&plan, &mut stack, &mut signals, &mut hangups).await;
    if result.is_err() {
        stack.teardown().await;
    }
    result
}

/// Everything decided before the first child starts.
struct Plan {
    args: LauncherArgs,
    model: ModelSource,
    server_bin: PathBuf,
    router_bin: PathBuf,
    sockets: Vec<PathBuf>,
}

async fn start_and_watch(
    plan: &Plan,
    stack: &mut Stack,
    signals: &mut ShutdownSignals,
    hangups: &mut Hangups,
) -> Result<(), LaunchError> {
    let args = &plan.args;
    let rendezvous = if args.num_shard > 1 {
        Some(Rendezvous {
            master_port: free_port()?,
        })
    } else {
        None
    };
    for (rank, socket) in (0..args.num_shard).zip(&plan.sockets) {
        let cmd = shard_command(
            args,
            &plan.server_bin,
            &plan.model,
            rank,
            socket,
            rendezvous,
        );
        let shard = ChildProcess::spawn(format!("shard {rank}"), &cmd)
            .map_err(|source| LaunchError::Spawn { source })?;
        stack.shards.push(shard);
    }
    tracing::info!(
        "started {} shard(s) for {}; waiting until each answers Health",
        args.num_shard,
        plan.model.model_id()
    );
    let startup_timeout = Duration::from_secs(args.shard_startup_timeout_secs);
    tokio::select! {
        signal = signals.recv() => {
            tracing::info!("{signal} received during start-up; stopping the shards");
            return stack.shutdown_gracefully(Duration::ZERO, signals).await;
        }
        (name, status) = first_exit(stack.shards.iter_mut()) => {
            return Err(died(name, status));
        }
        ready = wait_until_ready(&plan.sockets, startup_timeout) => ready?,
    }

    let cmd = router_command(args, &plan.router_bin, &plan.model, &plan.sockets);
    let router =
        ChildProcess::spawn("router", &cmd).map_err(|source| LaunchError::Spawn { source })?;
    stack.router = Some(router);
    tracing::info!(
        "router started; the API will be at http://{}:{}/v1",
        args.serving.hostname,
        args.serving.port
    );

    let grace = Duration::from_secs(args.serving.graceful_shutdown_secs);
    loop {
        let event = tokio::select! {
            signal = signals.recv() => Watched::Stop(signal),
            () = hangups.recv() => Watched::Hangup,
            (name, status) = first_exit(stack.router.iter_mut().chain(stack.shards.iter_mut())) => {
                Watched::Died(name, status)
            }
        };
        match event {
            Watched::Stop(signal) => {
                tracing::info!("{signal} received; draining the router for up to {grace:?}");
                return stack.shutdown_gracefully(grace, signals).await;
            }
            Watched::Hangup => {
                tracing::info!("SIGHUP received; passing it on to the router");
                if let Some(router) = &stack.router {
                    router.signal(Signal::SIGHUP);
                }
            }
            Watched::Died(name, status) => return Err(died(name, status)),
        }
    }
}

/// What ends a wait while everything runs.
enum Watched {
    Stop(&'static str),
    Hangup,
    Died(String, ExitStatus),
}

fn died(name: String, status: ExitStatus) -> LaunchError {
    tracing::error!(child = %name, "{name} exited unexpectedly ({status}); stopping everything");
    LaunchError::ChildDied { name, status }
}

/// The first of `children` to exit (those already reaped are skipped); never resolves if none
/// is left running.
async fn first_exit<'a>(
    children: impl Iterator<Item = &'a mut ChildProcess>,
) -> (String, ExitStatus) {
    let waits: Vec<_> = children
        .filter(|child| !child.has_exited())
        .map(|child| {
            Box::pin(async move {
                let status = child.wait().await;
                (child.name().to_owned(), status)
            })
        })
        .collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(waits).await.0
}

/// A port for torch.distributed's rendezvous that nothing listens on right now.
fn free_port() -> Result<u16, LaunchError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|source| LaunchError::Io {
            what: "pick a port for the shards' rendezvous".into(),
            source,
        })
}

/// The running children. Dropping it kills whatever is still running (each child's guard).
#[derive(Default)]
struct Stack {
    router: Option<ChildProcess>,
    shards: Vec<ChildProcess>,
}

impl Stack {
    fn all(&mut self) -> Vec<&mut ChildProcess> {
        self.router
            .iter_mut()
            .chain(self.shards.iter_mut())
            .collect()
    }

    /// The router first, so it stops admitting and drains in-flight requests within `grace`
    /// while the shards still serve them; then the shards. A second signal kills everything.
    async fn shutdown_gracefully(
        &mut self,
        grace: Duration,
        signals: &mut ShutdownSignals,
    ) -> Result<(), LaunchError> {
        let in_order = async {
            let mut clean = true;
            if let Some(router) = self.router.as_mut() {
                clean &= terminate_all(&mut [router], grace + ROUTER_EXTRA_STOP_TIME).await;
            }
            let mut shards: Vec<_> = self.shards.iter_mut().collect();
            clean &= terminate_all(&mut shards, SHARD_STOP_TIME).await;
            clean
        };
        let clean = tokio::select! {
            clean = in_order => clean,
            signal = signals.recv() => {
                tracing::warn!("{signal} received again; killing every child now");
                kill_all(&mut self.all()).await;
                return Err(LaunchError::Forced { signal });
            }
        };
        if clean {
            tracing::info!("all processes stopped; bye");
            Ok(())
        } else {
            Err(LaunchError::UncleanShutdown)
        }
    }

    /// After a failure: stop whatever still runs, all at once.
    async fn teardown(&mut self) {
        terminate_all(&mut self.all(), SHARD_STOP_TIME).await;
    }
}
