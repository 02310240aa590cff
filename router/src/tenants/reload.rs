//! SIGHUP reads `--api-keys-file` again. Requests in flight keep the grant they were admitted
//! with; the next request sees the new keys. A file that does not parse is logged and the keys
//! in use stay, so a typo never locks every tenant out.

use std::sync::Arc;

use tokio::signal::unix::{signal, Signal, SignalKind};

use super::Tenants;

/// Catches SIGHUP from now on. Called first thing at start-up, whatever the flags, so a SIGHUP
/// (the launcher passes its own on) never kills the router by its default action, even while
/// the model warms up; one that arrives before [`reload_on_sighup`] runs waits for it.
pub fn catch_sighup() -> std::io::Result<Signal> {
    signal(SignalKind::hangup())
}

/// Reloads the keys file on each SIGHUP for the rest of the process; without a keys file a
/// SIGHUP is only logged.
pub fn reload_on_sighup(mut hangups: Signal, tenants: Arc<Tenants>) {
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            if !tenants.reloadable() {
                tracing::info!("SIGHUP received; there is no --api-keys-file to reload");
                continue;
            }
            match tenants.reload() {
                Ok(keys) => tracing::info!(keys, "SIGHUP: API keys file reloaded"),
                Err(error) => tracing::error!(
                    %error,
                    "SIGHUP: API keys file not reloaded; the keys in use stay"
                ),
            }
        }
    });
}
