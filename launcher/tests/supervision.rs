//! The launcher binary against stand-in children: small shell scripts for quiver-server and
//! quiver-router that record how they were called (see `support`). The shard's gRPC Health is
//! answered by this test process, so the launcher's real readiness check runs unchanged.

mod support;

use std::os::unix::process::ExitStatusExt;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use support::harness::{value_after, Harness};

fn is_alive(pid: Pid) -> bool {
    // Zombies answer too, so this also proves the launcher reaped its children.
    kill(pid, None).is_ok()
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

    let router_args = h.child_args("router");
    let demo_dir = h.dir().join("cache").join("demo-model");
    assert!(demo_dir.join("config.json").is_file());
    assert_eq!(
        value_after(&router_args, "--served-model-name"),
        "quiver-demo"
    );
    assert_eq!(
        value_after(&router_args, "--model-id"),
        demo_dir.display().to_string()
    );
    // The demo adapter is served beside it, from the demo's own adapter directory.
    let adapters = demo_dir.join("adapters").display().to_string();
    assert_eq!(value_after(&router_args, "--adapter-source"), "local");
    assert_eq!(value_after(&router_args, "--adapter-root"), adapters);
    assert_eq!(
        value_after(&router_args, "--preload-adapters"),
        "quiver-demo-pirate"
    );
    let shard0 = h.child_args("shard-0");
    assert_eq!(
        shard0[..2],
        ["serve".to_owned(), demo_dir.display().to_string()]
    );
    assert_eq!(value_after(&shard0, "--adapter-root"), adapters);
    let sockets: Vec<_> = router_args
        .windows(2)
        .filter(|w| w[0] == "--shard-uds")
        .map(|w| w[1].clone())
        .collect();
    assert_eq!(
        sockets,
        [
            value_after(&shard0, "--uds-path"),
            value_after(&h.child_args("shard-1"), "--uds-path")
        ]
    );

    let pids = [h.pid_of("router"), h.pid_of("shard-0"), h.pid_of("shard-1")];
    // The shards' JSON log lines come through, tagged with the child.
    h.wait_log(&["fake shard loading", "shard 1"]);

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
    // The router was told first, the shards only after it had stopped. The launcher exits only
    // after the shards, so what they recorded on the way out is there.
    for rank in 0..2 {
        assert_eq!(
            h.read_out(&format!("shard-{rank}.stopped")),
            ["after-router"]
        );
    }
}

#[test]
fn a_cached_demo_model_of_another_version_is_written_again() {
    let rt = runtime();
    let mut h = Harness::new();
    // A complete demo model from before versions existed: no version file.
    let demo_dir = h.dir().join("cache").join("demo-model");
    std::fs::create_dir_all(&demo_dir).unwrap();
    std::fs::write(demo_dir.join("config.json"), "{\"old\": true}").unwrap();
    h.start(&[], &[]);
    h.serve_health(0, &rt);
    // The shard is told to serve the cache directory only once it holds the new model.
    assert_eq!(h.child_args("shard-0")[1], demo_dir.display().to_string());
    let config = std::fs::read_to_string(demo_dir.join("config.json")).unwrap();
    assert_eq!(config.trim(), "{}", "the old model was kept");
    let version = std::fs::read_to_string(demo_dir.join("quiver-demo-version")).unwrap();
    assert_eq!(version.trim(), "3");

    kill(h.launcher_pid(), Signal::SIGTERM).unwrap();
    assert_eq!(h.wait_exit().code(), Some(0), "{}", h.log());
}

#[test]
fn a_shard_dying_during_start_up_fails_naming_it() {
    let mut h = Harness::new();
    h.start(&["--model-id", "some/model"], &[("FAKE_SHARD_EXIT", "3")]);
    // Within the harness's deadline, far below the 30-minute start-up timeout; the log line
    // shows the shard's exit, not the timeout, was the reason.
    let status = h.wait_exit();
    assert!(!status.success(), "{}", h.log());
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
    // Logged as the drain starts; the router ignores its SIGTERM, so the drain goes on.
    h.wait_log(&["SIGTERM received; draining the router"]);
    assert!(h.is_running(), "the drain did not wait for the router");

    kill(h.launcher_pid(), Signal::SIGINT).unwrap();
    // The harness's deadline is below the 60 s grace period: an exit within it is at once.
    let status = h.wait_exit();
    assert!(!status.success(), "{}", h.log());
    assert!(h.log().contains("SIGINT received again"), "{}", h.log());
    assert!(!is_alive(router) && !is_alive(shard), "{}", h.log());
}
