//! The demo model: made once by `quiver-server demo-model` into the cache directory, then reused.

use std::path::{Path, PathBuf};

use crate::commands::demo_model_command;
use crate::error::LaunchError;
use crate::process::{terminate_all, ChildProcess};
use crate::signals::ShutdownSignals;

/// What `quiver-server demo-model` writes into `quiver-demo-version` (its DEMO_MODEL_VERSION):
/// a cached demo model of another version (an older chat template, say) is written again.
const DEMO_MODEL_VERSION: &str = "2";
const VERSION_FILE: &str = "quiver-demo-version";

/// Returns the demo model's directory, writing it first if needed; `None` if a shutdown signal
/// arrived while it was being written.
pub async fn ensure_demo_model(
    server_bin: &Path,
    cache_dir: &Path,
    signals: &mut ShutdownSignals,
) -> Result<Option<PathBuf>, LaunchError> {
    let dir = cache_dir.join("demo-model");
    if is_complete(&dir) {
        return Ok(Some(dir));
    }
    let io_err = |what: String| move |source| LaunchError::Io { what, source };
    std::fs::create_dir_all(cache_dir)
        .map_err(io_err(format!("create {}", cache_dir.display())))?;
    // Written beside its final place and renamed in one step, so an interrupted first run
    // never leaves a half-written model that later runs would take as complete.
    let staging = cache_dir.join(format!("demo-model.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    tracing::info!(
        "writing the demo model to {} (first run only)",
        dir.display()
    );
    let mut writer = ChildProcess::spawn("demo-model", &demo_model_command(server_bin, &staging))
        .map_err(|source| LaunchError::Spawn { source })?;
    let status = tokio::select! {
        signal = signals.recv() => {
            tracing::info!("{signal} received while writing the demo model; stopping");
            terminate_all(&mut [&mut writer], std::time::Duration::from_secs(10)).await;
            let _ = std::fs::remove_dir_all(&staging);
            return Ok(None);
        }
        status = writer.wait() => status,
    };
    if !status.success() || !is_complete(&staging) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(LaunchError::ChildFailed {
            name: "demo-model".into(),
            status,
        });
    }
    // An incomplete directory, or one of another version, is replaced.
    if dir.exists() && !is_complete(&dir) {
        std::fs::remove_dir_all(&dir).map_err(io_err(format!("remove {}", dir.display())))?;
    }
    if let Err(source) = std::fs::rename(&staging, &dir) {
        let _ = std::fs::remove_dir_all(&staging);
        // Another launcher sharing the cache finished first: use its copy.
        if !is_complete(&dir) {
            return Err(LaunchError::Io {
                what: format!("move the demo model to {}", dir.display()),
                source,
            });
        }
    }
    Ok(Some(dir))
}

/// Written in full by a demo-model writer of this launcher's version.
fn is_complete(dir: &Path) -> bool {
    let version = std::fs::read_to_string(dir.join(VERSION_FILE)).unwrap_or_default();
    dir.join("config.json").is_file() && version.trim() == DEMO_MODEL_VERSION
}
