//! Why the launcher stops with a non-zero exit code.

use std::process::ExitStatus;

use crate::health::NotReady;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("could not {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The message already names the child and its program.
    #[error("{source}")]
    Spawn { source: std::io::Error },
    #[error("no --cache-dir given and $HOME is not set")]
    NoCacheDir,
    #[error("{name} failed ({status})")]
    ChildFailed { name: String, status: ExitStatus },
    #[error("{name} exited unexpectedly ({status})")]
    ChildDied { name: String, status: ExitStatus },
    #[error(transparent)]
    NotReady(#[from] NotReady),
    #[error("shutdown was not clean: a child had to be killed or exited with an error")]
    UncleanShutdown,
    #[error("{signal} received again during shutdown: killed every child")]
    Forced { signal: &'static str },
}
