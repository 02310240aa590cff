//! The router's command line; every flag also reads `QUIVER_<FLAG>`.

use std::path::PathBuf;

use clap::Parser;

use crate::adapters::AdapterSource;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "quiver-router",
    version,
    about = "quiver's OpenAI-compatible HTTP router"
)]
pub struct RouterArgs {
    /// Address to listen on.
    #[arg(long, env = "QUIVER_HOSTNAME", default_value = "127.0.0.1")]
    pub hostname: String,

    /// Port to listen on.
    #[arg(long, env = "QUIVER_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Unix socket of each shard, rank 0 first (repeat the flag, or comma-separate).
    #[arg(
        long = "shard-uds",
        env = "QUIVER_SHARD_UDS",
        value_delimiter = ',',
        required = true
    )]
    pub shard_uds: Vec<PathBuf>,

    /// Hub id or directory of the base model, as given to the launcher; also accepted in `model`.
    #[arg(long, env = "MODEL_ID", default_value = "")]
    pub model_id: String,

    /// Name the base model is listed and answered under (default: --model-id).
    #[arg(long, env = "QUIVER_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,

    /// Longest prompt in tokens (default: --max-total-tokens - 1).
    #[arg(long, env = "QUIVER_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<u32>,

    /// Longest prompt + completion in tokens (default: the model's context, at most 4096).
    #[arg(long, env = "QUIVER_MAX_TOTAL_TOKENS")]
    pub max_total_tokens: Option<u32>,

    /// Most prompt tokens in one prefill batch (default: max(--max-input-tokens, 4096)).
    #[arg(long, env = "QUIVER_MAX_BATCH_PREFILL_TOKENS")]
    pub max_batch_prefill_tokens: Option<u32>,

    /// Cap on KV-cache token slots over all running requests (default: what the shard can hold).
    #[arg(long, env = "QUIVER_MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: Option<u32>,

    /// Most requests in one running batch.
    #[arg(long, env = "QUIVER_MAX_BATCH_SIZE", default_value_t = 256)]
    pub max_batch_size: u32,

    /// Requests admitted at once (running + queued); beyond it, 429.
    #[arg(long, env = "QUIVER_MAX_CONCURRENT_REQUESTS", default_value_t = 512)]
    pub max_concurrent_requests: u32,

    /// If set, requests must send `Authorization: Bearer <key>`.
    #[arg(long, env = "QUIVER_API_KEY")]
    pub api_key: Option<String>,

    /// Where adapter ids are looked up when a request has no `adapter_source`: hub or local.
    #[arg(long, env = "QUIVER_ADAPTER_SOURCE", value_enum, default_value_t = AdapterSource::Hub)]
    pub adapter_source: AdapterSource,

    /// Root directory of local adapters; local adapter ids resolve only inside it.
    #[arg(long, env = "QUIVER_ADAPTER_ROOT")]
    pub adapter_root: Option<PathBuf>,

    /// Adapters to load at start-up (comma-separated ids, looked up in --adapter-source);
    /// start-up fails if one cannot be loaded.
    #[arg(long, env = "QUIVER_PRELOAD_ADAPTERS", value_delimiter = ',')]
    pub preload_adapters: Vec<String>,

    /// Adapters resident on the device at once (device slots; more can be loaded in host
    /// memory and are swapped in as requests need them).
    #[arg(long, env = "QUIVER_MAX_ACTIVE_ADAPTERS", default_value_t = 8)]
    pub max_active_adapters: u32,

    /// Largest LoRA rank a device slot holds; adapters of higher rank are refused with 400.
    #[arg(long, env = "QUIVER_MAX_LORA_RANK", default_value_t = 64)]
    pub max_lora_rank: u32,

    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, env = "QUIVER_GRACEFUL_SHUTDOWN_SECS", default_value_t = 30)]
    pub graceful_shutdown_secs: u64,

    /// Log as JSON lines (for the launcher and log collectors).
    #[arg(long, env = "QUIVER_JSON_LOGS")]
    pub json_logs: bool,
}
