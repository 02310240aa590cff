//! Start-up, run once before the first request: resolve the limits against the model, warm the
//! shard up (it sizes the KV cache), start the scheduler on the blocks it reported, and preload
//! adapters. What comes out is the `AppState` the handlers share; nothing here runs per request.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use quiver_flags::{slot_ranks, RankClass};

use crate::adapters::{
    AdapterBackend, AdapterError, AdapterRegistry, AdapterSource, Resolver, ServingBackend,
};
use crate::config::RouterArgs;
use crate::core::{Infer, InferParts, Models, ServedModels};
use crate::http::{AppState, EmbeddingsInfo, ServedLimits, ServerInfo};
use crate::metrics::labels::AdapterLabels;
use crate::metrics::scheduler::SchedulerMetrics;
use crate::metrics::Metrics;
use crate::reasoning::{reasoning_parser_for, ReasoningParser, ReasoningParserFlag};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::shard::{ShardBackend, ShardError, ShardInfo, WarmupLimits};
use crate::template::ChatTemplate;
use crate::tenants::Tenants;
use crate::tool_calls::{parser_for, ToolCallParser};
use crate::validation::{
    default_max_logprob_entries, Limits, ModelAssets, RequestBounds, RequestedLimits, Validator,
};

/// The serving settings from the command line that shape the state.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub model_id: String,
    pub served_model_name: Option<String>,
    pub limits: RequestedLimits,
    pub max_batch_total_tokens: Option<u32>,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub api_key: Option<String>,
    /// `--api-keys-file` (not together with `api_key`).
    pub api_keys_file: Option<PathBuf>,
    pub adapters: AdapterSettings,
    pub admission: AdmissionSettings,
    /// `--tool-call-parser`.
    pub tool_call_parser: Option<ToolCallParser>,
    /// `--reasoning-parser`.
    pub reasoning_parser: Option<ReasoningParserFlag>,
    /// `--metrics-max-adapter-labels`.
    pub metrics_max_adapter_labels: usize,
    /// `--metrics-open`: /metrics without a key even when keys are configured.
    pub metrics_open: bool,
    /// `--prefix-caching`, `--chunked-prefill`, `--prefill-pace`, `--mixed-prefill`.
    pub prefix_caching: bool,
    pub chunked_prefill: bool,
    pub prefill_pace: f64,
    pub mixed_prefill: bool,
}

/// `--max-choices-per-request`, `--max-request-kv-share`, `--max-logprob-entries`,
/// `--max-stop-sequences`, `--preemption-wait-ms`, `--max-queue-wait-secs`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionSettings {
    pub max_choices_per_request: u32,
    pub max_request_kv_share: f64,
    /// `None`: `validation::default_max_logprob_entries` of the served context.
    pub max_logprob_entries: Option<u64>,
    pub max_stop_sequences: u32,
    pub preemption_wait: Duration,
    /// `None`: queued requests wait without a deadline.
    pub max_queue_wait: Option<Duration>,
}

/// The flags' defaults.
impl Default for AdmissionSettings {
    fn default() -> Self {
        Self {
            max_choices_per_request: 512,
            max_request_kv_share: 0.5,
            max_logprob_entries: None,
            max_stop_sequences: 16,
            preemption_wait: Duration::from_millis(500),
            max_queue_wait: None,
        }
    }
}

/// `--adapter-source`, `--adapter-root`, `--s3-adapter-buckets`, `--preload-adapters`,
/// `--max-active-adapters`, `--max-lora-rank`, `--lora-rank-classes`.
#[derive(Debug, Clone, Default)]
pub struct AdapterSettings {
    pub source: AdapterSource,
    pub root: Option<PathBuf>,
    /// `--s3-adapter-buckets`.
    pub s3_buckets: Vec<String>,
    pub preload: Vec<String>,
    /// Device slots; 0 serves no adapter (every adapter request fails in the scheduler).
    pub max_active_adapters: u32,
    pub max_lora_rank: u32,
    /// Slots that hold smaller ranks only; none: every slot holds `max_lora_rank`.
    pub lora_rank_classes: Vec<RankClass>,
}

impl Settings {
    pub fn from_args(args: &RouterArgs) -> Self {
        Self {
            model_id: args.model_id.clone(),
            served_model_name: args.serving.served_model_name.clone(),
            limits: RequestedLimits {
                max_input_tokens: args.serving.max_input_tokens,
                max_total_tokens: args.serving.max_total_tokens,
                max_batch_prefill_tokens: args.serving.max_batch_prefill_tokens,
            },
            max_batch_total_tokens: args.serving.max_batch_total_tokens,
            max_batch_size: args.serving.max_batch_size,
            max_concurrent_requests: args.serving.max_concurrent_requests,
            api_key: args.serving.api_key.clone().filter(|key| !key.is_empty()),
            api_keys_file: args.serving.api_keys_file.clone(),
            adapters: AdapterSettings {
                source: args.serving.adapter_source,
                root: args.serving.adapter_root.clone(),
                s3_buckets: args.serving.s3_adapter_buckets.clone(),
                preload: args.serving.preload_adapters.clone(),
                max_active_adapters: args.serving.max_active_adapters,
                max_lora_rank: args.serving.max_lora_rank,
                lora_rank_classes: args.serving.rank_classes().to_vec(),
            },
            tool_call_parser: args.serving.tool_call_parser,
            reasoning_parser: args.serving.reasoning_parser,
            metrics_max_adapter_labels: args.serving.metrics_max_adapter_labels as usize,
            metrics_open: args.serving.metrics_open,
            prefix_caching: args.serving.prefix_caching,
            chunked_prefill: args.serving.chunked_prefill,
            prefill_pace: args.serving.prefill_pace,
            mixed_prefill: args.serving.mixed_prefill,
            admission: AdmissionSettings {
                max_choices_per_request: args.serving.max_choices_per_request,
                max_request_kv_share: args.serving.max_request_kv_share,
                max_logprob_entries: args.serving.max_logprob_entries,
                max_stop_sequences: args.serving.max_stop_sequences,
                preemption_wait: Duration::from_millis(args.serving.preemption_wait_ms),
                max_queue_wait: (args.serving.max_queue_wait_secs > 0)
                    .then(|| Duration::from_secs(args.serving.max_queue_wait_secs)),
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("invalid limits: {0}")]
    Limits(String),
    #[error("shard warmup failed: {0}")]
    Warmup(ShardError),
    #[error("shard info failed: {0}")]
    Info(ShardError),
    #[error(
        "the KV cache holds {tokens} tokens ({num_blocks} blocks of {block_size}), fewer than \
         --max-total-tokens ({max_total_tokens}): lower --max-total-tokens or give the shard \
         more memory"
    )]
    CacheTooSmall {
        tokens: u64,
        num_blocks: u32,
        block_size: u32,
        max_total_tokens: u32,
    },
    #[error("{0}")]
    AdapterRoot(String),
    /// `--lora-rank-classes` does not fit `--max-active-adapters` and `--max-lora-rank`.
    #[error("{0}")]
    AdapterSlots(String),
    #[error("cannot preload adapter: {0}")]
    Preload(AdapterError),
    #[error("API keys: {0}")]
    ApiKeys(String),
}

/// Builds the shared state: limits, warmup, scheduler, adapter preload, in that order.
pub async fn start(
    shard: Arc<dyn ShardBackend>,
    info: ShardInfo,
    base: ModelAssets,
    settings: Settings,
) -> Result<AppState, StartupError> {
    let limits = Limits::resolve(
        settings.limits,
        info.max_position_embeddings,
        settings.chunked_prefill,
    )
    .map_err(StartupError::Limits)?;
    // Before the warmup: a bad --adapter-root or keys file should not cost a model warmup.
    let tenants = Tenants::new(settings.api_key.as_deref(), settings.api_keys_file.clone())
        .map_err(StartupError::ApiKeys)?;
    let resolver = Resolver::new(settings.adapters.source, settings.adapters.root.as_deref())
        .and_then(|resolver| resolver.with_s3_buckets(&settings.adapters.s3_buckets))
        .map_err(StartupError::AdapterRoot)?;
    let adapters = &settings.adapters;
    let slot_ranks = slot_ranks(
        &adapters.lora_rank_classes,
        adapters.max_active_adapters,
        adapters.max_lora_rank,
    )
    .map_err(StartupError::AdapterSlots)?;
    if let Some(cap) = settings.max_batch_total_tokens {
        if cap < limits.max_total_tokens {
            return Err(StartupError::Limits(format!(
                "--max-batch-total-tokens ({cap}) must be at least --max-total-tokens ({})",
                limits.max_total_tokens
            )));
        }
    }
    let cache = size_kv_cache(shard.as_ref(), &limits, &settings, &slot_ranks).await?;
    let model_id = if settings.model_id.is_empty() {
        info.model_id.clone()
    } else {
        settings.model_id
    };
    let served_name = settings
        .served_model_name
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| model_id.clone());
    // One adapter labelling for every per-adapter series; the base model by its served name.
    let labels = AdapterLabels::new(&served_name, settings.metrics_max_adapter_labels);
    let scheduler_metrics = Arc::new(SchedulerMetrics::new(Arc::new(labels)));
    let metrics = Arc::new(Metrics::new(scheduler_metrics.clone()));
    let ranks = shard.rank_infos().await.map_err(StartupError::Info)?;
    metrics.set_shard_weight_bytes(ranks.iter().map(|r| r.weight_bytes).collect());
    let scheduler = Scheduler::start_observed(
        shard.clone(),
        SchedulerConfig {
            block_size: cache.block_size,
            num_blocks: cache.num_blocks,
            max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
            max_batch_total_tokens: cache.max_batch_total_tokens,
            max_batch_size: settings.max_batch_size,
            max_concurrent_requests: settings.max_concurrent_requests,
            max_total_tokens: limits.max_total_tokens,
            max_active_adapters: settings.adapters.max_active_adapters,
            slot_ranks,
            preemption_wait: settings.admission.preemption_wait,
            max_queue_wait: settings.admission.max_queue_wait,
            prefix_caching: settings.prefix_caching,
            chunked_prefill: settings.chunked_prefill,
            prefill_pace: settings.prefill_pace,
            mixed_prefill: settings.mixed_prefill,
        },
        scheduler_metrics.clone(),
    );

    let usable_blocks = scheduler.stats().total_blocks;
    let max_logprob_entries = settings
        .admission
        .max_logprob_entries
        .unwrap_or_else(|| default_max_logprob_entries(limits.max_total_tokens));
    // EOS: what the model's generation config says, plus the tokenizer's own.
    let mut eos_token_ids = info.eos_token_ids.clone();
    eos_token_ids.extend_from_slice(base.tokenizer.stop_token_ids());
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();

    let server_info = ServerInfo {
        model_id: model_id.clone(),
        served_model_name: served_name.clone(),
        model_type: info.model_type.clone(),
        dtype: info.dtype.clone(),
        device: info.device.clone(),
        num_shards: info.world_size.max(1),
        vocab_size: info.vocab_size,
        max_position_embeddings: info.max_position_embeddings,
        eos_token_ids: eos_token_ids.clone(),
        limits: ServedLimits {
            max_input_tokens: limits.max_input_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
            max_batch_total_tokens: cache.max_batch_total_tokens,
            max_batch_size: settings.max_batch_size,
            max_concurrent_requests: settings.max_concurrent_requests,
            max_choices_per_request: settings.admission.max_choices_per_request,
            max_request_kv_share: settings.admission.max_request_kv_share,
            max_logprob_entries,
            max_stop_sequences: settings.admission.max_stop_sequences,
            preemption_wait_ms: settings.admission.preemption_wait.as_millis() as u64,
            max_queue_wait_secs: settings
                .admission
                .max_queue_wait
                .map_or(0, |wait| wait.as_secs()),
            block_size: cache.block_size,
            num_blocks: cache.num_blocks,
        },
        tool_call_parser: parser_for(
            settings.tool_call_parser,
            base.template.as_ref().map(ChatTemplate::source),
            false,
        )
        .name(),
        reasoning_parser: reasoning_parser_for(
            settings.reasoning_parser,
            base.template.as_ref().map(ChatTemplate::source),
            false,
        )
        .map(ReasoningParser::name),
        embeddings: EmbeddingsInfo {
            dimensions: info.embedding_dim,
            pooling: info.pooling.clone(),
            unavailable: Some(info.pooling_refusal.clone()).filter(|reason| !reason.is_empty()),
        },
        version: env!("CARGO_PKG_VERSION"),
    };
    let base = Arc::new(base);
    let backend: Arc<dyn AdapterBackend> = Arc::new(ServingBackend {
        shard: shard.clone(),
        scheduler: scheduler.clone(),
        metrics: metrics.clone(),
    });
    let adapters = AdapterRegistry::new(
        backend,
        base.clone(),
        resolver.canonical_root().map(Into::into),
    );
    preload(&adapters, &resolver, &settings.adapters.preload).await?;
    let models = Models::new(
        ServedModels {
            served_name,
            model_id,
            created: crate::openai::common::unix_now(),
        },
        base,
        adapters,
        resolver,
    );
    let validator = Validator {
        limits,
        vocab_size: info.vocab_size,
        eos_token_ids,
        max_stop_sequences: settings.admission.max_stop_sequences,
        bounds: RequestBounds::new(
            settings.admission.max_choices_per_request,
            settings.admission.max_request_kv_share,
            cache.block_size,
            usable_blocks,
        ),
        max_logprob_entries,
        tool_call_parser: settings.tool_call_parser,
        reasoning_parser: settings.reasoning_parser,
    };
    let infer = Infer::new(InferParts {
        scheduler,
        shard,
        metrics,
        validator,
        models,
        generation_refusal: Some(info.generation_refusal.clone()).filter(|r| !r.is_empty()),
        embeddings_refusal: server_info.embeddings.unavailable.clone(),
    });
    Ok(AppState {
        infer,
        info: Arc::new(server_info),
        tenants: Arc::new(tenants),
        metrics_open: settings.metrics_open,
    })
}

/// The KV cache as the shard's warmup sized it, and the token cap the scheduler works within.
struct KvCache {
    block_size: u32,
    num_blocks: u32,
    /// `--max-batch-total-tokens`, never more than the cache holds.
    max_batch_total_tokens: u32,
}

/// Warms the shard up with the worst case the limits allow, and its adapter slots with their
/// ranks (`slot_ranks`, empty: all at `--max-lora-rank`); the cache it reports must hold at
/// least one request of `max_total_tokens`, or no request of that size could ever run.
async fn size_kv_cache(
    shard: &dyn ShardBackend,
    limits: &Limits,
    settings: &Settings,
    slot_ranks: &[u32],
) -> Result<KvCache, StartupError> {
    let warmup = shard
        .warmup(WarmupLimits {
            // A prompt that is never chunked (it wants prompt logprobs) is computed whole.
            max_batch_prefill_tokens: limits.max_batch_prefill_tokens.max(limits.max_input_tokens),
            max_total_tokens: limits.max_total_tokens,
            max_batch_size: settings.max_batch_size,
            max_batch_total_tokens: settings.max_batch_total_tokens.unwrap_or(0),
            max_active_adapters: settings.adapters.max_active_adapters,
            max_lora_rank: settings.adapters.max_lora_rank,
            slot_ranks: slot_ranks.to_vec(),
        })
        .await
        .map_err(StartupError::Warmup)?;
    let cache_tokens = u64::from(warmup.block_size) * u64::from(warmup.num_blocks);
    if cache_tokens < u64::from(limits.max_total_tokens) {
        return Err(StartupError::CacheTooSmall {
            tokens: cache_tokens,
            num_blocks: warmup.num_blocks,
            block_size: warmup.block_size,
            max_total_tokens: limits.max_total_tokens,
        });
    }
    let max_batch_total_tokens = settings
        .max_batch_total_tokens
        .map_or(cache_tokens, u64::from)
        .min(cache_tokens)
        .min(u64::from(u32::MAX)) as u32;
    Ok(KvCache {
        block_size: warmup.block_size,
        num_blocks: warmup.num_blocks,
        max_batch_total_tokens,
    })
}

/// `--preload-adapters`, all at once; any failure stops start-up.
async fn preload(
    adapters: &AdapterRegistry,
    resolver: &Resolver,
    ids: &[String],
) -> Result<(), StartupError> {
    let loads = ids
        .iter()
        .map(|id| id.trim())
        .filter(|id| !id.is_empty())
        .map(|id| async move {
            let spec = resolver.resolve(id, None)?;
            adapters.load(spec).await
        });
    futures::future::try_join_all(loads)
        .await
        .map_err(StartupError::Preload)?;
    Ok(())
}
