//! One supervised child process. The guard kills the child when dropped, so no early return or
//! panic in the launcher leaves a shard or router running.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::child_logs;
use crate::commands::CommandLine;

/// How long a dead child's last output may take to reach the log: a grandchild that inherited
/// the pipe could hold it open forever.
const OUTPUT_DRAIN_TIME: Duration = Duration::from_secs(2);

pub struct ChildProcess {
    name: String,
    child: Child,
    exit: Option<ExitStatus>,
    forwarders: Vec<JoinHandle<()>>,
}

impl ChildProcess {
    /// Starts `command` with its output forwarded into the launcher's log under `name`.
    pub fn spawn(name: impl Into<String>, command: &CommandLine) -> std::io::Result<Self> {
        let name = name.into();
        let mut cmd = Command::new(&command.program);
        cmd.args(&command.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // Its own process group: a Ctrl-C in the terminal reaches only the launcher, which
            // then stops the children in order (router drains first) instead of all at once.
            .process_group(0);
        for key in &command.env_remove {
            cmd.env_remove(key);
        }
        cmd.envs(command.env.iter().map(|(k, v)| (k, v)));
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls
        // (prctl, getppid, _exit).
        unsafe {
            let launcher = nix::unistd::getpid();
            cmd.pre_exec(move || die_with_parent(launcher));
        }
        let mut child = cmd.spawn().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "could not start {name} ({}): {e}",
                    command.program.display()
                ),
            )
        })?;
        let mut forwarders = Vec::new();
        if let Some(stdout) = child.stdout.take() {
            forwarders.push(tokio::spawn(child_logs::forward(name.clone(), stdout)));
        }
        if let Some(stderr) = child.stderr.take() {
            forwarders.push(tokio::spawn(child_logs::forward(name.clone(), stderr)));
        }
        tracing::debug!(child = %name, pid = child.id(), "started {}", command.program.display());
        Ok(ChildProcess {
            name,
            child,
            exit: None,
            forwarders,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends `signal` if the child is still running. Tokio forgets the pid once it has reaped
    /// the child, so a recycled pid is never signalled.
    pub fn signal(&self, signal: Signal) {
        if self.exit.is_some() {
            return;
        }
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), signal);
        }
    }

    /// Waits for the child to exit and its last output to be logged (a crash's traceback comes
    /// before the launcher's word on it); cancel-safe, and the status is remembered.
    pub async fn wait(&mut self) -> ExitStatus {
        if let Some(status) = self.exit {
            return status;
        }
        let status = self.child.wait().await.unwrap_or_else(|e| {
            // Only if the child was already reaped behind tokio's back; count it as a failure.
            tracing::warn!(child = %self.name, "could not wait for {}: {e}", self.name);
            ExitStatus::from_raw(1 << 8)
        });
        self.exit = Some(status);
        let drained = futures::future::join_all(self.forwarders.drain(..));
        let _ = tokio::time::timeout(OUTPUT_DRAIN_TIME, drained).await;
        status
    }

    pub fn has_exited(&self) -> bool {
        self.exit.is_some()
    }
}

/// SIGTERM to every child at once, then up to `timeout` for all of them to exit, then SIGKILL
/// for the stragglers. Logs each one's end; returns true if all stopped on their own and cleanly.
pub async fn terminate_all(children: &mut [&mut ChildProcess], timeout: Duration) -> bool {
    for child in children.iter() {
        child.signal(Signal::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut clean = true;
    // Children that were already gone have had their end reported by whoever saw it.
    for child in children.iter_mut().filter(|child| !child.has_exited()) {
        let status = match tokio::time::timeout_at(deadline, child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(child = %child.name, "{} did not stop within {timeout:?}; killing it", child.name);
                child.signal(Signal::SIGKILL);
                clean = false;
                child.wait().await
            }
        };
        if stopped_cleanly(status) {
            tracing::info!(child = %child.name, "{} stopped ({status})", child.name);
        } else {
            tracing::warn!(child = %child.name, "{} stopped ({status})", child.name);
            clean = false;
        }
    }
    clean
}

/// SIGKILL to every child still running, then reaps them.
pub async fn kill_all(children: &mut [&mut ChildProcess]) {
    for child in children.iter_mut() {
        child.signal(Signal::SIGKILL);
        child.wait().await;
    }
}

/// A status that counts as a normal stop after the launcher asked the child to stop.
pub fn stopped_cleanly(status: ExitStatus) -> bool {
    status.success() || status.signal() == Some(Signal::SIGTERM as i32)
}

/// Runs in the child before exec: if the launcher dies (even by SIGKILL), the kernel kills the
/// child too. The pid check closes the race where the launcher died before the prctl.
fn die_with_parent(launcher: Pid) -> std::io::Result<()> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
    if nix::unistd::getppid() != launcher {
        // SAFETY: _exit is async-signal-safe and the right way to leave a forked child.
        unsafe { nix::libc::_exit(1) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A fifo a test child writes `ready` to once its SIGTERM trap is set: signalled before
    /// that, the shell would die of the signal instead of showing how it handles it.
    struct Ready {
        _dir: tempfile::TempDir,
        path: PathBuf,
    }

    impl Ready {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("ready");
            nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
            Ready { _dir: dir, path }
        }

        /// `script` with `$READY` naming the fifo.
        fn sh(&self, script: &str) -> CommandLine {
            let mut cmd = sh(script);
            cmd.env
                .push(("READY".into(), self.path.display().to_string()));
            cmd
        }

        /// Opening the fifo blocks until the child opens it to write, so this waits for the
        /// child's word rather than for time to pass; the timeout only turns a hang into a
        /// failure.
        async fn wait(&self) {
            let path = self.path.clone();
            let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(path));
            let text = tokio::time::timeout(Duration::from_secs(30), read)
                .await
                .expect("the child never said it was ready")
                .unwrap()
                .unwrap();
            assert_eq!(text.trim(), "ready");
        }
    }

    fn sh(script: &str) -> CommandLine {
        CommandLine {
            program: PathBuf::from("/bin/sh"),
            args: vec!["-c".into(), script.into()],
            env: vec![("QUIVER_TEST_VALUE".into(), "7".into())],
            env_remove: vec![],
        }
    }

    #[tokio::test]
    async fn reports_exit_status_and_environment_reaches_child() {
        let mut child = ChildProcess::spawn("t", &sh("exit $QUIVER_TEST_VALUE")).unwrap();
        assert_eq!(child.wait().await.code(), Some(7));
        assert!(child.has_exited());
        // Remembered, and signalling an exited child is a no-op.
        child.signal(Signal::SIGTERM);
        assert_eq!(child.wait().await.code(), Some(7));
    }

    #[tokio::test]
    async fn terminate_escalates_to_sigkill_when_sigterm_is_ignored() {
        let ready = Ready::new();
        let script = "trap '' TERM; echo ready > \"$READY\"; exec sleep 5";
        let mut child = ChildProcess::spawn("stubborn", &ready.sh(script)).unwrap();
        ready.wait().await;
        assert!(!terminate_all(&mut [&mut child], Duration::from_millis(300)).await);
        let status = child.wait().await;
        assert_eq!(status.signal(), Some(Signal::SIGKILL as i32));
        assert!(!stopped_cleanly(status));
    }

    #[tokio::test]
    async fn terminate_is_clean_for_children_that_obey_sigterm() {
        // `a` stops by the signal itself, `b` by its trap, which must be set before the signal.
        let mut a = ChildProcess::spawn("a", &sh("exec sleep 5")).unwrap();
        let ready = Ready::new();
        let script = "sleep 5 & s=$!; trap 'kill $s; exit 0' TERM; echo ready > \"$READY\"; wait";
        let mut b = ChildProcess::spawn("b", &ready.sh(script)).unwrap();
        ready.wait().await;
        assert!(terminate_all(&mut [&mut a, &mut b], Duration::from_secs(5)).await);
        assert!(a.has_exited() && b.has_exited());
    }

    #[tokio::test]
    async fn missing_program_names_the_child() {
        let cmd = CommandLine {
            program: PathBuf::from("/nonexistent/quiver-router"),
            args: vec![],
            env: vec![],
            env_remove: vec![],
        };
        let err = ChildProcess::spawn("router", &cmd).err().unwrap();
        assert!(err.to_string().contains("could not start router"));
    }
}
