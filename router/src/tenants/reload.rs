//! SIGHUP reads `--api-keys-file` again. Requests in flight keep the grant they were admitted
//! with; the next request sees the new keys. A file that does not parse is logged and the keys
//! in use stay, so a typo never locks every tenant out.

use std::sync::Arc;

use tokio::signal::unix::{signal, SignalKind};

use super::Tenants;

/// Listens for SIGHUP for the rest of the process. Installed whatever the flags, so a stray
/// SIGHUP never kills the router (its default action); without a keys file it is only logged.
pub fn reload_on_sighup(tenants: Arc<Tenants>) -> std::io::Result<()> {
    let mut hangups = signal(SignalKind::hangup())?;
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
    Ok(())
}
