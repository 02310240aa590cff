//! The launcher's private directory for the shards' unix sockets; removed when dropped.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

pub struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    /// `$TMPDIR/quiver-<pid>`, mode 0700 so other users cannot talk to the shards. Kept short:
    /// a unix socket path may hold at most 107 bytes.
    pub fn create() -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!("quiver-{}", std::process::id()));
        // A leftover from an earlier process with the same pid (e.g. killed by SIGKILL).
        if path.exists() {
            std::fs::remove_dir_all(&path)?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(SocketDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
