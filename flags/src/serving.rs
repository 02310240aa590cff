//! The serving flags' one definition: names, environment variables, defaults and `--help` text.

use std::path::PathBuf;

use clap::Args;

use crate::{AdapterSource, RankClass, RankClasses, ReasoningParserFlag, ToolCallParser};

/// The variable the API key is read from. The launcher hands the key to the router through it,
/// never on the command line, where `ps` shows it to every user.
pub const API_KEY_ENV: &str = "QUIVER_API_KEY";

/// HTTP, limits, adapters and shutdown: what the router needs and the launcher passes on.
/// Flags without a default here (the token limits) are worked out by the router at start-up,
/// from the model and the KV cache the shards report.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct ServingFlags {
    /// Port the HTTP API listens on.
    #[arg(long, env = "QUIVER_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Address the HTTP API listens on (0.0.0.0 to accept connections from other machines).
    #[arg(long, env = "QUIVER_HOSTNAME", default_value = "127.0.0.1")]
    pub hostname: String,

    /// Longest prompt in tokens (router default: --max-total-tokens - 1).
    #[arg(long, env = "QUIVER_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<u32>,

    /// Longest prompt + completion in tokens (router default: the model's context, at most 4096).
    #[arg(long, env = "QUIVER_MAX_TOTAL_TOKENS")]
    pub max_total_tokens: Option<u32>,

    /// Most prompt tokens computed in one step, prefix-cache hits not counted (router default:
    /// 2048 with chunked prefill, else max(--max-input-tokens, 4096)).
    #[arg(long, env = "QUIVER_MAX_BATCH_PREFILL_TOKENS")]
    pub max_batch_prefill_tokens: Option<u32>,

    /// Share the KV of common prompt prefixes between requests of the same adapter (automatic
    /// prefix caching: full blocks named by a hash of the adapter and every token up to them;
    /// unreferenced cached blocks are evicted least recently used first).
    #[arg(long, env = "QUIVER_PREFIX_CACHING", default_value_t = true,
          action = clap::ArgAction::Set)]
    pub prefix_caching: bool,

    /// Prefill prompts longer than what is left of --max-batch-prefill-tokens in a step in
    /// chunks over several steps, each step also decoding the running requests, so a long
    /// prompt does not stall them.
    #[arg(long, env = "QUIVER_CHUNKED_PREFILL", default_value_t = true,
          action = clap::ArgAction::Set)]
    pub chunked_prefill: bool,

    /// While requests decode and fewer than a quarter as many wait for their first token, size
    /// each step's prefill (prompt chunks and new prompts) to take about this many times a
    /// decode step (both measured as the server runs), so that a long prompt slows the running
    /// streams by a bounded factor instead of stalling them; 0 always fills
    /// --max-batch-prefill-tokens.
    #[arg(long, env = "QUIVER_PREFILL_PACE", default_value_t = 1.0,
          value_parser = parse_pace)]
    pub prefill_pace: f64,

    /// While requests decode, run each step's prefill in the same shard call and forward pass
    /// as their decode (a mixed step: the weights are read once for both); false runs a
    /// Prefill, then a Decode, as two calls.
    #[arg(long, env = "QUIVER_MIXED_PREFILL", default_value_t = true,
          action = clap::ArgAction::Set)]
    pub mixed_prefill: bool,

    /// Cap on KV-cache token slots over all running requests (router default: all the shard holds).
    #[arg(long, env = "QUIVER_MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: Option<u32>,

    /// Most requests in one running batch.
    #[arg(long, env = "QUIVER_MAX_BATCH_SIZE", default_value_t = 256)]
    pub max_batch_size: u32,

    /// Requests admitted at once, running + queued; beyond it, 429. One request counts once,
    /// whatever its `n` and number of prompts.
    #[arg(long, env = "QUIVER_MAX_CONCURRENT_REQUESTS", default_value_t = 512)]
    pub max_concurrent_requests: u32,

    /// Most choices (`n` × prompts) one request may ask for; more is refused with 400 before
    /// any prompt is tokenized.
    #[arg(long, env = "QUIVER_MAX_CHOICES_PER_REQUEST", default_value_t = 512)]
    pub max_choices_per_request: u32,

    /// Largest share of the KV cache one request's choices may reserve together
    /// (n × prompts × blocks of prompt + max_tokens); more is refused with 400.
    #[arg(long, env = "QUIVER_MAX_REQUEST_KV_SHARE", default_value_t = 0.5,
          value_parser = parse_share)]
    pub max_request_kv_share: f64,

    /// Most logprob entries one response may carry: over all its choices, each reported prompt
    /// or generated position counts its token and its alternatives (echoed prompt tokens ×
    /// (`logprobs` + 1) + `max_tokens` × (`logprobs` or `top_logprobs` + 1)); more is refused
    /// with 400 before any prompt is scheduled (router default: 6 × --max-total-tokens, at least
    /// 262144, so one whole context echoed with `logprobs: 5` always fits).
    #[arg(long, env = "QUIVER_MAX_LOGPROB_ENTRIES")]
    pub max_logprob_entries: Option<u64>,

    /// Most stop strings (`stop`) one request may give; more is refused with 400. OpenAI allows
    /// 4, too few for clients that add their own (lm-eval appends EOS to its `until` list).
    #[arg(long, env = "QUIVER_MAX_STOP_SEQUENCES", default_value_t = 16)]
    pub max_stop_sequences: u32,

    /// How long the request at the head of a queue may wait for KV blocks or a batch slot
    /// before running requests are preempted (and later resumed) to make room.
    #[arg(long, env = "QUIVER_PREEMPTION_WAIT_MS", default_value_t = 500)]
    pub preemption_wait_ms: u64,

    /// Seconds a request may wait in the queue before it is refused with 503 `queue_timeout`;
    /// 0 waits without limit (preemption still bounds the wait of a request at a queue head).
    #[arg(long, env = "QUIVER_MAX_QUEUE_WAIT_SECS", default_value_t = 0)]
    pub max_queue_wait_secs: u64,

    /// Where adapter ids are looked up when a request does not say.
    #[arg(long, env = "QUIVER_ADAPTER_SOURCE", value_enum, default_value_t = AdapterSource::Hub)]
    pub adapter_source: AdapterSource,

    /// Root directory of local adapters; local adapter ids resolve only inside it.
    #[arg(long, env = "QUIVER_ADAPTER_ROOT")]
    pub adapter_root: Option<PathBuf>,

    /// S3 buckets adapters may be loaded from (`s3://bucket/prefix` ids), comma-separated; ids
    /// naming any other bucket are refused. None: S3 adapters are off. Credentials and the
    /// endpoint come from the standard AWS configuration (environment, shared files).
    #[arg(long, env = "QUIVER_S3_ADAPTER_BUCKETS", value_delimiter = ',')]
    pub s3_adapter_buckets: Vec<String>,

    /// Adapters to load at start-up (comma-separated ids, looked up in --adapter-source);
    /// start-up fails if one cannot be loaded.
    #[arg(long, env = "QUIVER_PRELOAD_ADAPTERS", value_delimiter = ',')]
    pub preload_adapters: Vec<String>,

    /// Adapters resident on the device at once, in preallocated LoRA slots.
    #[arg(long, env = "QUIVER_MAX_ACTIVE_ADAPTERS", default_value_t = 8)]
    pub max_active_adapters: u32,

    /// Largest LoRA rank a device slot holds; adapters of higher rank are refused.
    #[arg(long, env = "QUIVER_MAX_LORA_RANK", default_value_t = 64)]
    pub max_lora_rank: u32,

    /// Adapter slots that hold smaller ranks only, as RANK:COUNT pairs (comma-separated): COUNT
    /// of the --max-active-adapters slots hold ranks up to RANK, and take less device memory;
    /// the other slots hold --max-lora-rank. An adapter runs in the smallest free slot its rank
    /// fits. Each RANK below --max-lora-rank and given once; at least one slot stays outside
    /// the classes. Default: every slot holds --max-lora-rank.
    #[arg(long, env = "QUIVER_LORA_RANK_CLASSES")]
    pub lora_rank_classes: Option<RankClasses>,

    /// Name the base model is listed and answered under (default: --model-id, or quiver-demo for
    /// the demo model).
    #[arg(long, env = "QUIVER_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,

    /// If set, requests must send `Authorization: Bearer <key>`. Passed to the router through its
    /// environment, never on its command line.
    #[arg(long, env = API_KEY_ENV, hide_env_values = true)]
    pub api_key: Option<String>,

    /// YAML file of API keys (by SHA-256), each with the adapters it may use, whether it may use
    /// the base model and load/unload adapters, and its own limits; reloaded on SIGHUP. Not
    /// together with --api-key. See docs/multi-tenancy.md.
    #[arg(long, env = "QUIVER_API_KEYS_FILE", conflicts_with = "api_key")]
    pub api_keys_file: Option<PathBuf>,

    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT before the router stops.
    #[arg(long, env = "QUIVER_GRACEFUL_SHUTDOWN_SECS", default_value_t = 30)]
    pub graceful_shutdown_secs: u64,

    /// Seconds a client gets to send a request's complete headers, counted from its first byte
    /// (or from the connection's opening); slower connections are closed (slowloris).
    #[arg(long, env = "QUIVER_HEADER_READ_TIMEOUT_SECS", default_value_t = 10)]
    pub header_read_timeout_secs: u64,

    /// Seconds a request's whole body may take to arrive, counted from its headers; a body
    /// still incomplete then gets 408 and its connection is closed.
    #[arg(long, env = "QUIVER_BODY_READ_TIMEOUT_SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout_secs: u64,

    /// Bytes per second a request body must keep up once its first 5 seconds have passed (each
    /// such many bytes received move its deadline one second later, up to
    /// --body-read-timeout-secs); a body that falls behind gets 408. 0: only the whole-body
    /// timeout holds.
    #[arg(long, env = "QUIVER_BODY_READ_MIN_RATE", default_value_t = 1024)]
    pub body_read_min_rate: u64,

    /// Seconds a keep-alive connection may sit idle between requests before it is closed.
    #[arg(long, env = "QUIVER_KEEP_ALIVE_TIMEOUT_SECS", default_value_t = 60)]
    pub keep_alive_timeout_secs: u64,

    /// Open HTTP connections at once; further connections wait in the listen backlog until one
    /// closes.
    #[arg(long, env = "QUIVER_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: u32,

    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, env = "QUIVER_MAX_REQUEST_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_request_body_bytes: usize,

    /// The tool-call format (vLLM's parser names) chat replies are constrained to and read in
    /// when a request declares `tools`. Default: detected from the chat template (an adapter's
    /// own template gets its own detection), else hermes.
    #[arg(long, env = "QUIVER_TOOL_CALL_PARSER", value_enum)]
    pub tool_call_parser: Option<ToolCallParser>,

    /// How chat replies of a thinking model are split into `reasoning_content` and `content`
    /// (vLLM's parser names; `none`: no split for any model). Default: detected from the chat
    /// template (an adapter's own template gets its own detection), else no split.
    #[arg(long, env = "QUIVER_REASONING_PARSER", value_enum)]
    pub reasoning_parser: Option<ReasoningParserFlag>,

    /// Serve /metrics to anyone who can reach the port, API keys or not. Without it, once
    /// --api-key or --api-keys-file is set, /metrics needs an admin key (it names every adapter
    /// and key); open it only where the port is firewalled to the scrapers.
    #[arg(long, env = "QUIVER_METRICS_OPEN", default_value_t = false,
          action = clap::ArgAction::Set)]
    pub metrics_open: bool,

    /// Adapters that get their own `adapter` label in /metrics (the first ones requested);
    /// later ones share the label `other`, so series stay bounded however many adapters come
    /// and go. The base model is always labelled with its own name.
    #[arg(long, env = "QUIVER_METRICS_MAX_ADAPTER_LABELS", default_value_t = 32)]
    pub metrics_max_adapter_labels: u32,

    /// OTLP/gRPC collector that traces are exported to (e.g. http://otel-collector:4317); the
    /// router and every shard send their spans there. Unset: no tracing, no exporter.
    #[arg(long, env = "QUIVER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// `service.name` of the router's spans; the shards report as `<name>-shard`.
    #[arg(long, env = "QUIVER_OTEL_SERVICE_NAME", default_value = "quiver")]
    pub otel_service_name: String,
}

impl ServingFlags {
    /// `--lora-rank-classes`, none when unset.
    pub fn rank_classes(&self) -> &[RankClass] {
        self.lora_rank_classes
            .as_ref()
            .map_or(&[], |classes| classes.0.as_slice())
    }
}

/// A pace of prefill against decode: finite, at least 0.
fn parse_pace(text: &str) -> Result<f64, String> {
    let pace: f64 = text.parse().map_err(|error| format!("{error}"))?;
    if pace.is_finite() && pace >= 0.0 {
        Ok(pace)
    } else {
        Err(format!("must be a finite number of at least 0, got {text}"))
    }
}

/// A share of the KV cache: more than 0, at most 1.
fn parse_share(text: &str) -> Result<f64, String> {
    let share: f64 = text.parse().map_err(|error| format!("{error}"))?;
    if share > 0.0 && share <= 1.0 {
        Ok(share)
    } else {
        Err(format!("must be more than 0 and at most 1, got {text}"))
    }
}
