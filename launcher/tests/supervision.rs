//! The launcher binary against stand-in children: small shell scripts (written here) for
//! quiver-server and quiver-router that record how they were called. The shard's gRPC Health is
//! answered by this test process on the socket path the launcher handed the script, so the
//! launcher's real readiness check runs unchanged.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

mod pb {
    tonic::include_proto!("quiver.v1");
}

const WAIT: Duration = Duration::from_secs(30);

/// Stands in for `quiver-server`: `demo-model DIR` writes a config.json; `serve` records its
/// arguments and pid, exits with $FAKE_SHARD_EXIT if set, else runs until SIGTERM.
const FAKE_SERVER: &str = r#"#!/bin/sh
if [ "$1" = "demo-model" ]; then
  mkdir -p "$2" && echo '{}' > "$2/config.json"
  exit 0
fi
rank=x; prev=
for a in "$@"; do [ "$prev" = "--rank" ] && rank="$a"; prev="$a"; done
on_term() {
  if [ -e "$FAKE_OUT/router.stopped" ]; then order=after-router; else order=before-router; fi
  echo "$order" > "$FAKE_OUT/shard-$rank.stopped"
  kill "$sleeper" 2>/dev/null
  exit 0
}
# Before the pid file appears: the tests signal as soon as they see it.
trap on_term TERM
echo $$ > "$FAKE_OUT/shard-$rank.pid"
printf '%s\n' "$@" > "$FAKE_OUT/shard-$rank.args.tmp"
mv "$FAKE_OUT/shard-$rank.args.tmp" "$FAKE_OUT/shard-$rank.args"
echo '{"level":"INFO","message":"fake shard loading","target":"fake"}' >&2
if [ -n "$FAKE_SHARD_EXIT" ]; then exit "$FAKE_SHARD_EXIT"; fi
sleep 600 & sleeper=$!
wait "$sleeper"
"#;

/// Stands in for `quiver-router`: records its arguments and pid, exits with $FAKE_ROUTER_EXIT
/// if set, ignores SIGTERM (a drain that never ends) if $FAKE_ROUTER_IGNORE_TERM is set, else
/// runs until SIGTERM.
const FAKE_ROUTER: &str = r#"#!/bin/sh
# Signal handling is set up before the pid file appears: the tests signal as soon as they see it.
if [ -n "$FAKE_ROUTER_IGNORE_TERM" ]; then
  trap '' TERM
else
  trap 'touch "$FAKE_OUT/router.stopped"; kill "$sleeper" 2>/dev/null; exit 0' TERM
fi
echo $$ > "$FAKE_OUT/router.pid"
printf '%s\n' "$@" > "$FAKE_OUT/router.args.tmp"
mv "$FAKE_OUT/router.args.tmp" "$FAKE_OUT/router.args"
if [ -n "$FAKE_ROUTER_EXIT" ]; then sleep 0.2; exit "$FAKE_ROUTER_EXIT"; fi
if [ -n "$FAKE_ROUTER_IGNORE_TERM" ]; then exec sleep 30; fi
sleep 600 & sleeper=$!
wait "$sleeper"
"#;

/// A launcher run with fake children inside its own temporary directory.
struct Harness {
    dir: tempfile::TempDir,
    launcher: Option<Child>,
}

impl Harness {
    fn new() -> Self {
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
        Harness {
            dir,
            launcher: None,
        }
    }

    fn out(&self) -> PathBuf {
        self.dir.path().join("out")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("launcher.log")
    }

    fn start(&mut self, extra_args: &[&str], env: &[(&str, &str)]) {
        let log = std::fs::File::create(self.log_path()).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_quiver-launcher"));
        cmd.arg("--server-bin")
            .arg(self.dir.path().join("fake-server"))
            .arg("--router-bin")
            .arg(self.dir.path().join("fake-router"))
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .args(extra_args)
            .env("FAKE_OUT", self.out())
            .env("TMPDIR", self.dir.path().join("tmp"))
            .env("RUST_LOG", "info")
            .env_remove("MODEL_ID")
            .env_remove("QUIVER_MODEL_ID")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.launcher = Some(cmd.spawn().unwrap());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn launcher_pid(&self) -> Pid {
        Pid::from_raw(self.launcher.as_ref().unwrap().id() as i32)
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        let launcher = self.launcher.as_mut().unwrap();
        loop {
            if let Some(status) = launcher.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "launcher still running\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for a file the fake children write, and returns its lines.
    fn wait_file(&self, name: &str) -> Vec<String> {
        let path = self.out().join(name);
        let deadline = Instant::now() + WAIT;
        while !path.exists() {
            assert!(Instant::now() < deadline, "no {name}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    fn pid_of(&self, name: &str) -> Pid {
        Pid::from_raw(self.wait_file(&format!("{name}.pid"))[0].parse().unwrap())
    }

    /// Answers Health for the shard of `rank` on the socket the launcher gave it.
    fn serve_health(&self, rank: u32, runtime: &tokio::runtime::Runtime) {
        let socket = PathBuf::from(value_after(
            &self.wait_file(&format!("shard-{rank}.args")),
            "--uds-path",
        ));
        runtime.spawn(serve_fake_shard(socket));
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(launcher) = self.launcher.as_mut() {
            let _ = launcher.kill();
            let _ = launcher.wait();
        }
    }
}

fn value_after(args: &[String], flag: &str) -> String {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[at + 1].clone()
}

fn is_alive(pid: Pid) -> bool {
    // Zombies answer too, so this also proves the launcher reaped its children.
    kill(pid, None).is_ok()
}

async fn serve_fake_shard(socket: PathBuf) {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tonic::transport::Server::builder()
        .add_service(pb::shard_server::ShardServer::new(HealthyShard))
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
        .await
        .unwrap();
}

/// Answers Health; nothing else is called before the router starts.
struct HealthyShard;

#[tonic::async_trait]
impl pb::shard_server::Shard for HealthyShard {
    async fn info(
        &self,
        _: tonic::Request<pb::InfoRequest>,
    ) -> Result<tonic::Response<pb::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn health(
        &self,
        _: tonic::Request<pb::HealthRequest>,
    ) -> Result<tonic::Response<pb::HealthResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::HealthResponse {}))
    }
    async fn warmup(
        &self,
        _: tonic::Request<pb::WarmupRequest>,
    ) -> Result<tonic::Response<pb::WarmupResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn prefill(
        &self,
        _: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<pb::PrefillResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn decode(
        &self,
        _: tonic::Request<pb::DecodeRequest>,
    ) -> Result<tonic::Response<pb::DecodeResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn filter_batch(
        &self,
        _: tonic::Request<pb::FilterBatchRequest>,
    ) -> Result<tonic::Response<pb::FilterBatchResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn clear_cache(
        &self,
        _: tonic::Request<pb::ClearCacheRequest>,
    ) -> Result<tonic::Response<pb::ClearCacheResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn load_adapter(
        &self,
        _: tonic::Request<pb::LoadAdapterRequest>,
    ) -> Result<tonic::Response<pb::LoadAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn activate_adapter(
        &self,
        _: tonic::Request<pb::ActivateAdapterRequest>,
    ) -> Result<tonic::Response<pb::ActivateAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
    async fn unload_adapter(
        &self,
        _: tonic::Request<pb::UnloadAdapterRequest>,
    ) -> Result<tonic::Response<pb::UnloadAdapterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("fake"))
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn sigterm_drains_the_router_then_stops_the_shards_and_exits_zero() {
    let rt = runtime();
    let mut h = Harness::new();
    // No --model-id: the demo model is written once, then served as quiver-demo.
    h.start(&["--num-shard", "2"], &[]);
    h.serve_health(0, &rt);
    h.serve_health(1, &rt);

    let router_args = h.wait_file("router.args");
    let demo_dir = h.dir.path().join("cache").join("demo-model");
    assert!(demo_dir.join("config.json").is_file());
    assert_eq!(
        value_after(&router_args, "--served-model-name"),
        "quiver-demo"
    );
    assert_eq!(
        value_after(&router_args, "--model-id"),
        demo_dir.display().to_string()
    );
    let shard0 = h.wait_file("shard-0.args");
    assert_eq!(
        shard0[..2],
        ["serve".to_owned(), demo_dir.display().to_string()]
    );
    let sockets: Vec<_> = router_args
        .windows(2)
        .filter(|w| w[0] == "--shard-uds")
        .map(|w| w[1].clone())
        .collect();
    assert_eq!(
        sockets,
        [
            value_after(&shard0, "--uds-path"),
            value_after(&h.wait_file("shard-1.args"), "--uds-path")
        ]
    );

    let pids = [h.pid_of("router"), h.pid_of("shard-0"), h.pid_of("shard-1")];
    // The shards' JSON log lines come through, tagged with the child.
    let deadline = Instant::now() + WAIT;
    while !h.log().contains("fake shard loading") {
        assert!(
            Instant::now() < deadline,
            "shard log not forwarded\n{}",
            h.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(h.log().contains("shard 1"), "{}", h.log());

    kill(h.launcher_pid(), Signal::SIGTERM).unwrap();
    let status = h.wait_exit();
    assert_eq!(status.code(), Some(0), "{}", h.log());
    for pid in pids {
        assert!(
            !is_alive(pid),
            "child {pid} outlived the launcher\n{}",
            h.log()
        );
    }
    // The router was told first, the shards only after it had stopped.
    for rank in 0..2 {
        assert_eq!(
            h.wait_file(&format!("shard-{rank}.stopped")),
            ["after-router"]
        );
    }
}

#[test]
fn a_shard_dying_during_start_up_fails_fast_naming_it() {
    let mut h = Harness::new();
    let started = Instant::now();
    h.start(&["--model-id", "some/model"], &[("FAKE_SHARD_EXIT", "3")]);
    let status = h.wait_exit();
    assert!(!status.success(), "{}", h.log());
    // Long before the start-up timeout (30 min by default).
    assert!(started.elapsed() < Duration::from_secs(20));
    let log = h.log();
    assert!(
        log.contains("shard 0 exited unexpectedly (exit status: 3)"),
        "{log}"
    );
    assert!(
        !h.out().join("router.args").exists(),
        "router started without a ready shard"
    );
}

#[test]
fn the_router_dying_stops_the_shards_and_exits_nonzero_naming_it() {
    let rt = runtime();
    let mut h = Harness::new();
    h.start(&["--model-id", "some/model"], &[("FAKE_ROUTER_EXIT", "7")]);
    h.serve_health(0, &rt);
    let shard = h.pid_of("shard-0");
    let status = h.wait_exit();
    assert!(!status.success(), "{}", h.log());
    assert!(
        status.signal().is_none(),
        "the launcher crashed: {status:?}"
    );
    let log = h.log();
    assert!(
        log.contains("router exited unexpectedly (exit status: 7)"),
        "{log}"
    );
    assert!(!is_alive(shard), "shard outlived the launcher\n{log}");
}

#[test]
fn a_second_signal_during_the_drain_kills_everything_at_once() {
    let rt = runtime();
    let mut h = Harness::new();
    h.start(
        &["--model-id", "some/model", "--graceful-shutdown-secs", "60"],
        &[("FAKE_ROUTER_IGNORE_TERM", "1")],
    );
    h.serve_health(0, &rt);
    let (router, shard) = (h.pid_of("router"), h.pid_of("shard-0"));
    kill(h.launcher_pid(), Signal::SIGTERM).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let launcher = h.launcher.as_mut().unwrap();
    assert!(
        launcher.try_wait().unwrap().is_none(),
        "the drain did not wait for the router"
    );

    let signalled = Instant::now();
    kill(h.launcher_pid(), Signal::SIGINT).unwrap();
    let status = h.wait_exit();
    assert!(signalled.elapsed() < Duration::from_secs(10), "not at once");
    assert!(!status.success(), "{}", h.log());
    assert!(h.log().contains("SIGINT received again"), "{}", h.log());
    assert!(!is_alive(router) && !is_alive(shard), "{}", h.log());
}
