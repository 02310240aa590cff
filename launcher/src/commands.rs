//! How the launcher's flags become the children's command lines. Pure functions, so the mapping
//! is unit-tested without spawning anything.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::args::{flag_value, LauncherArgs, ModelSource};

/// A program with its arguments and the environment changes it gets on top of the launcher's.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandLine {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub env_remove: Vec<String>,
}

impl CommandLine {
    fn new(program: &Path) -> Self {
        CommandLine {
            program: program.to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            env_remove: Vec::new(),
        }
    }

    fn arg(&mut self, arg: impl Into<OsString>) -> &mut Self {
        self.args.push(arg.into());
        self
    }

    fn flag(&mut self, name: &str, value: impl Into<OsString>) -> &mut Self {
        self.arg(name).arg(value)
    }

    fn flag_if_set<T: ToString>(&mut self, name: &str, value: Option<T>) -> &mut Self {
        if let Some(value) = value {
            self.flag(name, value.to_string());
        }
        self
    }
}

/// The socket shard `rank` serves on, inside the launcher's private runtime directory.
pub fn shard_socket(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("quiver-shard-{rank}.sock"))
}

/// Rendezvous for torch.distributed when there is more than one rank (the env:// convention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rendezvous {
    pub master_port: u16,
}

/// `quiver-server serve MODEL --uds-path ... --rank r --world-size N ...` for one rank.
pub fn shard_command(
    args: &LauncherArgs,
    server_bin: &Path,
    model: &ModelSource,
    rank: u32,
    socket: &Path,
    rendezvous: Option<Rendezvous>,
) -> CommandLine {
    let mut cmd = CommandLine::new(server_bin);
    cmd.arg("serve")
        .arg(model.model_id())
        .flag("--uds-path", socket)
        .flag("--rank", rank.to_string())
        .flag("--world-size", args.num_shard.to_string())
        .flag("--dtype", flag_value(args.dtype))
        .flag("--device", flag_value(args.device))
        .flag_if_set("--cpu-kv-cache-gib", args.cpu_kv_cache_gib)
        .flag_if_set("--gpu-memory-fraction", args.gpu_memory_fraction)
        .flag_if_set("--max-cpu-adapters", args.max_cpu_adapters)
        // The launcher parses the shards' JSON lines and re-logs them in its own format.
        .arg("--json-logs");
    // A revision only means something for a hub id; the demo model is a local directory.
    if let ModelSource::User(_) = model {
        cmd.flag_if_set("--revision", args.revision.as_deref());
    }
    if let Some(rdv) = rendezvous {
        cmd.env.extend([
            ("RANK".into(), rank.to_string()),
            ("LOCAL_RANK".into(), rank.to_string()),
            ("WORLD_SIZE".into(), args.num_shard.to_string()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), rdv.master_port.to_string()),
        ]);
    }
    // The shards never need the API key; keep secrets out of processes that don't use them.
    cmd.env_remove.push("QUIVER_API_KEY".into());
    cmd
}

/// `quiver-router` with the serving flags the user set (or the launcher's defaults) and the
/// shards' sockets, rank 0 first.
pub fn router_command(
    args: &LauncherArgs,
    router_bin: &Path,
    model: &ModelSource,
    shard_sockets: &[PathBuf],
) -> CommandLine {
    let mut cmd = CommandLine::new(router_bin);
    cmd.flag("--hostname", &args.hostname)
        .flag("--port", args.port.to_string())
        .flag("--model-id", model.model_id());
    for socket in shard_sockets {
        cmd.flag("--shard-uds", socket);
    }
    cmd.flag_if_set("--served-model-name", args.served_model_name(model))
        .flag_if_set("--max-input-tokens", args.max_input_tokens)
        .flag_if_set("--max-total-tokens", args.max_total_tokens)
        .flag_if_set("--max-batch-prefill-tokens", args.max_batch_prefill_tokens)
        .flag_if_set("--max-batch-total-tokens", args.max_batch_total_tokens)
        .flag_if_set("--max-batch-size", args.max_batch_size)
        .flag_if_set("--max-concurrent-requests", args.max_concurrent_requests)
        .flag("--adapter-source", flag_value(args.adapter_source));
    if let Some(root) = &args.adapter_root {
        cmd.flag("--adapter-root", root);
    }
    if !args.preload_adapters.is_empty() {
        cmd.flag("--preload-adapters", args.preload_adapters.join(","));
    }
    cmd.flag_if_set("--max-active-adapters", args.max_active_adapters)
        .flag_if_set("--max-lora-rank", args.max_lora_rank)
        .flag(
            "--graceful-shutdown-secs",
            args.graceful_shutdown_secs.to_string(),
        )
        .arg("--json-logs");
    // Through the environment: a command line is visible to every user in `ps`.
    match &args.api_key {
        Some(key) => cmd.env.push(("QUIVER_API_KEY".into(), key.clone())),
        None => cmd.env_remove.push("QUIVER_API_KEY".into()),
    }
    cmd
}

/// `quiver-server demo-model DIR --json-logs`.
pub fn demo_model_command(server_bin: &Path, dir: &Path) -> CommandLine {
    let mut cmd = CommandLine::new(server_bin);
    cmd.arg("demo-model").arg(dir).arg("--json-logs");
    cmd
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn parse(argv: &[&str]) -> LauncherArgs {
        LauncherArgs::try_parse_from(std::iter::once("quiver-launcher").chain(argv.iter().copied()))
            .unwrap()
    }

    fn strings(cmd: &CommandLine) -> Vec<String> {
        cmd.args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn value_of(cmd: &CommandLine, flag: &str) -> Option<String> {
        let args = strings(cmd);
        let at = args.iter().position(|a| a == flag)?;
        args.get(at + 1).cloned()
    }

    #[test]
    fn shard_gets_model_socket_rank_and_placement() {
        let args = parse(&[
            "--model-id",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "--revision",
            "main",
            "--num-shard",
            "2",
            "--dtype",
            "bfloat16",
            "--device",
            "cuda",
            "--gpu-memory-fraction",
            "0.8",
            "--max-cpu-adapters",
            "16",
        ]);
        let model = ModelSource::User(args.requested_model_id().unwrap());
        let cmd = shard_command(
            &args,
            Path::new("/bin/quiver-server"),
            &model,
            1,
            Path::new("/run/q/quiver-shard-1.sock"),
            None,
        );
        assert_eq!(cmd.program, PathBuf::from("/bin/quiver-server"));
        assert_eq!(
            strings(&cmd),
            [
                "serve",
                "Qwen/Qwen2.5-0.5B-Instruct",
                "--uds-path",
                "/run/q/quiver-shard-1.sock",
                "--rank",
                "1",
                "--world-size",
                "2",
                "--dtype",
                "bfloat16",
                "--device",
                "cuda",
                "--gpu-memory-fraction",
                "0.8",
                "--max-cpu-adapters",
                "16",
                "--json-logs",
                "--revision",
                "main",
            ]
        );
        assert!(cmd.env_remove.contains(&"QUIVER_API_KEY".to_owned()));
    }

    #[test]
    fn shard_defaults_are_auto_and_unset_flags_stay_off() {
        let args = parse(&["--model-id", "/models/llama"]);
        let model = ModelSource::User("/models/llama".into());
        let cmd = shard_command(
            &args,
            Path::new("quiver-server"),
            &model,
            0,
            Path::new("/s"),
            None,
        );
        assert_eq!(value_of(&cmd, "--dtype").as_deref(), Some("auto"));
        assert_eq!(value_of(&cmd, "--device").as_deref(), Some("auto"));
        assert_eq!(value_of(&cmd, "--world-size").as_deref(), Some("1"));
        for absent in [
            "--revision",
            "--cpu-kv-cache-gib",
            "--gpu-memory-fraction",
            "--max-cpu-adapters",
        ] {
            assert!(
                value_of(&cmd, absent).is_none(),
                "{absent} should not be passed"
            );
        }
        assert!(cmd.env.is_empty());
    }

    #[test]
    fn multi_rank_shards_get_a_torch_distributed_rendezvous() {
        let args = parse(&["--model-id", "m", "--num-shard", "2"]);
        let model = ModelSource::User("m".into());
        let rdv = Some(Rendezvous { master_port: 29555 });
        let cmd = shard_command(&args, Path::new("s"), &model, 1, Path::new("/s"), rdv);
        let env: std::collections::HashMap<_, _> = cmd.env.iter().cloned().collect();
        assert_eq!(env["RANK"], "1");
        assert_eq!(env["WORLD_SIZE"], "2");
        assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(env["MASTER_PORT"], "29555");
    }

    #[test]
    fn router_gets_serving_flags_and_every_socket_in_rank_order() {
        let args = parse(&[
            "--model-id",
            "org/model",
            "--port",
            "9000",
            "--hostname",
            "0.0.0.0",
            "--max-input-tokens",
            "1000",
            "--max-total-tokens",
            "2048",
            "--max-batch-prefill-tokens",
            "4096",
            "--max-batch-total-tokens",
            "100000",
            "--max-batch-size",
            "32",
            "--max-concurrent-requests",
            "64",
            "--adapter-source",
            "local",
            "--adapter-root",
            "/adapters",
            "--preload-adapters",
            "a,b",
            "--max-active-adapters",
            "4",
            "--max-lora-rank",
            "32",
            "--served-model-name",
            "my-model",
            "--graceful-shutdown-secs",
            "7",
        ]);
        let model = ModelSource::User("org/model".into());
        let sockets = [PathBuf::from("/r/s0.sock"), PathBuf::from("/r/s1.sock")];
        let cmd = router_command(&args, Path::new("/bin/quiver-router"), &model, &sockets);
        assert_eq!(
            strings(&cmd),
            [
                "--hostname",
                "0.0.0.0",
                "--port",
                "9000",
                "--model-id",
                "org/model",
                "--shard-uds",
                "/r/s0.sock",
                "--shard-uds",
                "/r/s1.sock",
                "--served-model-name",
                "my-model",
                "--max-input-tokens",
                "1000",
                "--max-total-tokens",
                "2048",
                "--max-batch-prefill-tokens",
                "4096",
                "--max-batch-total-tokens",
                "100000",
                "--max-batch-size",
                "32",
                "--max-concurrent-requests",
                "64",
                "--adapter-source",
                "local",
                "--adapter-root",
                "/adapters",
                "--preload-adapters",
                "a,b",
                "--max-active-adapters",
                "4",
                "--max-lora-rank",
                "32",
                "--graceful-shutdown-secs",
                "7",
                "--json-logs",
            ]
        );
    }

    #[test]
    fn router_leaves_its_own_defaults_alone() {
        let args = parse(&["--model-id", "m"]);
        let cmd = router_command(
            &args,
            Path::new("r"),
            &ModelSource::User("m".into()),
            &[PathBuf::from("/s")],
        );
        for absent in [
            "--served-model-name",
            "--max-input-tokens",
            "--max-total-tokens",
            "--max-batch-prefill-tokens",
            "--max-batch-total-tokens",
            "--max-batch-size",
            "--max-concurrent-requests",
            "--adapter-root",
            "--preload-adapters",
            "--max-active-adapters",
            "--max-lora-rank",
        ] {
            assert!(
                value_of(&cmd, absent).is_none(),
                "{absent} should not be passed"
            );
        }
        assert_eq!(value_of(&cmd, "--port").as_deref(), Some("8080"));
        assert_eq!(value_of(&cmd, "--hostname").as_deref(), Some("127.0.0.1"));
        assert_eq!(value_of(&cmd, "--adapter-source").as_deref(), Some("hub"));
        assert_eq!(
            value_of(&cmd, "--graceful-shutdown-secs").as_deref(),
            Some("30")
        );
    }

    #[test]
    fn api_key_reaches_the_router_by_environment_only() {
        let args = parse(&["--model-id", "m", "--api-key", "sk-secret"]);
        let cmd = router_command(
            &args,
            Path::new("r"),
            &ModelSource::User("m".into()),
            &[PathBuf::from("/s")],
        );
        assert!(!strings(&cmd).iter().any(|a| a.contains("sk-secret")));
        assert!(cmd
            .env
            .contains(&("QUIVER_API_KEY".into(), "sk-secret".into())));
    }

    #[test]
    fn demo_model_is_served_from_its_directory_as_quiver_demo() {
        let args = parse(&["--revision", "v1"]);
        let demo = ModelSource::Demo {
            dir: PathBuf::from("/cache/demo-model"),
        };
        let router = router_command(&args, Path::new("r"), &demo, &[PathBuf::from("/s")]);
        assert_eq!(
            value_of(&router, "--model-id").as_deref(),
            Some("/cache/demo-model")
        );
        assert_eq!(
            value_of(&router, "--served-model-name").as_deref(),
            Some("quiver-demo")
        );
        let shard = shard_command(&args, Path::new("s"), &demo, 0, Path::new("/s"), None);
        assert_eq!(strings(&shard)[1], "/cache/demo-model");
        assert!(value_of(&shard, "--revision").is_none());
        assert_eq!(
            strings(&demo_model_command(Path::new("s"), Path::new("/cache/x"))),
            ["demo-model", "/cache/x", "--json-logs"]
        );
    }
}
