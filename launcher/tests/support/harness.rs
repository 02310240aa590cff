//! One launcher run against the fake children, inside its own temporary directory. Every wait
//! is on the event itself (a line on the fake children's fifo, a line of the launcher's output,
//! the launcher's exit), bounded by `WAIT` only so that a broken launcher fails instead of
//! hanging the test.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::signal::{killpg, Signal};
use nix::sys::stat::Mode;
use nix::sys::wait::{waitid, Id, WaitPidFlag};
use nix::unistd::{mkfifo, Pid};

use super::fake_children::{FAKE_ROUTER, FAKE_SERVER};
use super::fake_shard::serve_fake_shard;
use super::lines::Lines;

/// The failure guard on every wait; what is awaited normally comes within milliseconds.
const WAIT: Duration = Duration::from_secs(30);

pub struct Harness {
    dir: tempfile::TempDir,
    events: Lines,
    /// Held so the event reader never sees end-of-file between two children's writes; dropped
    /// with the harness, which ends the reader's thread.
    _events_writer: File,
    launcher: Option<Launcher>,
}

struct Launcher {
    child: Child,
    /// Sends once when the launcher has exited (not yet reaped: `child` alone reaps it, so its
    /// pid is never reused while the harness may still signal it).
    exited: Receiver<()>,
    has_exited: bool,
    output: Lines,
}

impl Harness {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("ql").tempdir().unwrap();
        for (name, body) in [("fake-server", FAKE_SERVER), ("fake-router", FAKE_ROUTER)] {
            let path = dir.path().join(name);
            std::fs::write(&path, body).unwrap();
            let mut perms = std::fs::metadata(&path).unwrap().permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
            std::fs::set_permissions(&path, perms).unwrap();
        }
        std::fs::create_dir(dir.path().join("out")).unwrap();
        std::fs::create_dir(dir.path().join("tmp")).unwrap();
        let (events, events_writer) = open_fifo(&dir.path().join("events"));
        Harness {
            dir,
            events: Lines::read(events),
            _events_writer: events_writer,
            launcher: None,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Where the fake children record their arguments, pids and how they stopped.
    pub fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    pub fn start(&mut self, extra_args: &[&str], env: &[(&str, &str)]) {
        let (output, writer) = std::io::pipe().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_quiver-launcher"))
            .arg("--server-bin")
            .arg(self.dir.path().join("fake-server"))
            .arg("--router-bin")
            .arg(self.dir.path().join("fake-router"))
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .args(extra_args)
            .env("FAKE_OUT", self.out())
            .env("FAKE_EVENTS", self.dir.path().join("events"))
            .env("TMPDIR", self.dir.path().join("tmp"))
            .env("RUST_LOG", "info")
            .env_remove("MODEL_ID")
            .env_remove("QUIVER_MODEL_ID")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(writer.try_clone().unwrap())
            .stderr(writer)
            .spawn()
            .unwrap();
        // The Command and its copies of the pipe's write end are gone by now, so the output
        // ends when the launcher exits.
        let pid = Pid::from_raw(child.id() as i32);
        let (sender, exited) = mpsc::channel();
        std::thread::spawn(move || {
            let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
            while let Err(Errno::EINTR) = waitid(Id::Pid(pid), flags) {}
            let _ = sender.send(());
        });
        self.launcher = Some(Launcher {
            child,
            exited,
            has_exited: false,
            output: Lines::read(output),
        });
    }

    fn launcher(&mut self) -> &mut Launcher {
        self.launcher.as_mut().expect("the launcher was started")
    }

    pub fn launcher_pid(&mut self) -> Pid {
        Pid::from_raw(self.launcher().child.id() as i32)
    }

    /// The launcher's output so far.
    pub fn log(&mut self) -> String {
        self.launcher().output.text()
    }

    pub fn is_running(&mut self) -> bool {
        let launcher = self.launcher();
        launcher.has_exited |= !matches!(launcher.exited.try_recv(), Err(TryRecvError::Empty));
        !launcher.has_exited
    }

    /// Waits for the launcher to exit and for the last of its output, which `log` then holds.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        let launcher = self.launcher();
        if !launcher.has_exited && launcher.exited.recv_timeout(WAIT).is_err() {
            panic!("launcher still running\n{}", self.log());
        }
        launcher.has_exited = true;
        let status = launcher.child.wait().unwrap();
        if !launcher.output.wait_for_end(deadline) {
            panic!("something kept the launcher's output open\n{}", self.log());
        }
        status
    }

    /// Waits for a line of the launcher's output that contains every one of `parts`.
    pub fn wait_log(&mut self, parts: &[&str]) -> String {
        let deadline = Instant::now() + WAIT;
        let found = self
            .launcher()
            .output
            .wait_for(deadline, |line| {
                parts.iter().all(|part| line.contains(part))
            })
            .map(str::to_owned);
        found.unwrap_or_else(|| panic!("no line with {parts:?} in the log\n{}", self.log()))
    }

    /// Waits until the fake child `name` (`router`, `shard-0`, ...) has recorded itself.
    fn wait_ready(&mut self, name: &str) {
        let event = format!("{name} ready");
        let deadline = Instant::now() + WAIT;
        if self
            .events
            .wait_for(deadline, |line| line == event)
            .is_none()
        {
            panic!("{name} never started\n{}", self.log());
        }
    }

    /// The arguments the fake child `name` was started with, once it has started.
    pub fn child_args(&mut self, name: &str) -> Vec<String> {
        self.wait_ready(name);
        self.read_out(&format!("{name}.args"))
    }

    pub fn pid_of(&mut self, name: &str) -> Pid {
        self.wait_ready(name);
        Pid::from_raw(self.read_out(&format!("{name}.pid"))[0].parse().unwrap())
    }

    /// The lines of a file the fake children wrote, which must be there by now.
    pub fn read_out(&self, name: &str) -> Vec<String> {
        let text = std::fs::read_to_string(self.out().join(name))
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        text.lines().map(str::to_owned).collect()
    }

    /// Answers Health for the shard of `rank` on the socket the launcher gave it.
    pub fn serve_health(&mut self, rank: u32, runtime: &tokio::runtime::Runtime) {
        let args = self.child_args(&format!("shard-{rank}"));
        runtime.spawn(serve_fake_shard(PathBuf::from(value_after(
            &args,
            "--uds-path",
        ))));
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(launcher) = self.launcher.as_mut() {
            // No-ops once the launcher has been reaped; its children die with it (pdeathsig).
            let _ = launcher.child.kill();
            let _ = launcher.child.wait();
        }
        self.kill_stray_sleepers();
    }
}

impl Harness {
    /// A fake child the launcher killed with SIGKILL leaves its `sleep 600` behind. Each child
    /// leads its own process group, which lives on with the sleeper in it, so its id cannot
    /// have been handed to anyone else.
    fn kill_stray_sleepers(&self) {
        let Ok(entries) = std::fs::read_dir(self.out()) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.path().extension().is_some_and(|ext| ext == "pid") {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                if let Ok(pid) = text.trim().parse() {
                    let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
    }
}

/// A fifo for the fake children's events: the read end, and a write end for the harness to hold.
/// Opening the read end alone would block until a writer appears, hence non-blocking first,
/// then blocking reads once the harness's own writer keeps it open.
fn open_fifo(path: &Path) -> (File, File) {
    mkfifo(path, Mode::S_IRUSR | Mode::S_IWUSR).unwrap();
    let reader = OpenOptions::new()
        .read(true)
        .custom_flags(OFlag::O_NONBLOCK.bits())
        .open(path)
        .unwrap();
    let writer = OpenOptions::new().write(true).open(path).unwrap();
    fcntl(&reader, FcntlArg::F_SETFL(OFlag::empty())).unwrap();
    (reader, writer)
}

/// The value after `flag` in a recorded command line.
pub fn value_after(args: &[String], flag: &str) -> String {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[at + 1].clone()
}
