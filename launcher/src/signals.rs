//! SIGTERM and SIGINT, the two ways to ask the launcher to stop. Installed before any child is
//! started, so a signal during start-up is handled (children stopped) instead of killing the
//! launcher outright.

use tokio::signal::unix::{signal, Signal, SignalKind};

pub struct ShutdownSignals {
    term: Signal,
    int: Signal,
}

impl ShutdownSignals {
    pub fn install() -> std::io::Result<Self> {
        Ok(ShutdownSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT and returns its name.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// SIGHUP, which the launcher passes on to the router (it reloads `--api-keys-file`). Installed
/// at start like the others, so a SIGHUP during start-up neither kills the launcher nor is
/// lost: it waits and reaches the router once that runs.
pub struct Hangups(Signal);

impl Hangups {
    pub fn install() -> std::io::Result<Self> {
        Ok(Hangups(signal(SignalKind::hangup())?))
    }

    pub async fn recv(&mut self) {
        self.0.recv().await;
    }
}
