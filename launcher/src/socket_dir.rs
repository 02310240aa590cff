//! The launcher's private directory for the shards' unix sockets; removed when dropped, and by
//! the next launcher when this one was killed before it could (SIGKILL runs no destructor).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;

/// The directory name's prefix; the rest is the launcher's pid.
const PREFIX: &str = "quiver-";

pub struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    /// `$TMPDIR/quiver-<pid>`, mode 0700 so other users cannot talk to the shards. Kept short:
    /// a unix socket path may hold at most 107 bytes.
    pub fn create() -> std::io::Result<Self> {
        Self::create_in(&std::env::temp_dir())
    }

    /// As `create`, under `parent`; first removes what launchers that are gone left there.
    pub fn create_in(parent: &Path) -> std::io::Result<Self> {
        remove_left_behind(parent);
        let path = parent.join(format!("{PREFIX}{}", std::process::id()));
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

/// Removes the socket directories of launchers that no longer run: `quiver-<pid>` for a pid
/// with no process. A live pid's directory stays (it may be another launcher's, or a stranger
/// that reused the pid: its files are not ours to judge), and so does anything we may not
/// remove (another user's). Best effort: a directory that cannot be read is left alone.
fn remove_left_behind(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(PREFIX))
            .and_then(|pid| pid.parse::<i32>().ok())
            .filter(|pid| *pid > 0)
        else {
            continue;
        };
        let is_dir = entry.file_type().is_ok_and(|kind| kind.is_dir());
        if is_dir && kill(Pid::from_raw(pid), None) == Err(Errno::ESRCH) {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => tracing::info!(
                    pid,
                    "removed the socket directory of a launcher that is gone"
                ),
                Err(error) => {
                    tracing::debug!(pid, %error, "cannot remove a stale socket directory")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pid of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_killed_launchers_directory_is_removed_a_live_ones_is_kept() {
        let parent = tempfile::tempdir().unwrap();
        let gone = parent.path().join(format!("{PREFIX}{}", dead_pid()));
        std::fs::create_dir(&gone).unwrap();
        std::fs::write(gone.join("quiver-shard-0.sock"), b"").unwrap();
        // pid 1 always runs; names that are not a launcher's stay whatever they hold.
        let alive = parent.path().join(format!("{PREFIX}1"));
        let foreign = parent.path().join(format!("{PREFIX}shard-7"));
        let file = parent
            .path()
            .join(format!("{PREFIX}{}", dead_pid()) + ".log");
        for dir in [&alive, &foreign] {
            std::fs::create_dir(dir).unwrap();
        }
        std::fs::write(&file, b"").unwrap();

        let own = SocketDir::create_in(parent.path()).unwrap();

        assert!(
            !gone.exists(),
            "the dead launcher's directory is still there"
        );
        assert!(alive.exists() && foreign.exists() && file.exists());
        assert!(own.path().is_dir());
        let own_path = own.path().to_path_buf();
        drop(own);
        assert!(!own_path.exists());
    }
}
