//! Everything the handlers share, built once at start-up: the scheduler handle, the shard (for
//! `/health`), the validator, the base model's tokenizer and template, the adapter registry,
//! and what `/info` and `/v1/models` report.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

use crate::adapters::{
    AdapterBackend, AdapterError, AdapterRegistry, AdapterSource, Resolver, ServingBackend,
};
use crate::config::RouterArgs;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::models::ModelCard;
use crate::pb;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::shard::{ShardBackend, ShardError};
use crate::validation::{Limits, ModelAssets, RequestedLimits, Validator};

#[derive(Clone)]
pub struct AppState {
    pub scheduler: Scheduler,
    pub shard: Arc<dyn ShardBackend>,
    pub validator: Arc<Validator>,
    pub base: Arc<ModelAssets>,
    pub models: Arc<ServedModels>,
    pub info: Arc<ServerInfo>,
    pub metrics: Arc<Metrics>,
    /// `Authorization: Bearer <key>` required on `/v1/*` when set.
    pub api_key: Option<Arc<str>>,
    /// Loaded adapters, and where ids not loaded yet are looked up.
    pub adapters: AdapterRegistry,
    pub resolver: Arc<Resolver>,
}

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
    pub adapters: AdapterSettings,
}

/// `--adapter-source`, `--adapter-root`, `--preload-adapters`, `--max-active-adapters`,
/// `--max-lora-rank`.
#[derive(Debug, Clone, Default)]
pub struct AdapterSettings {
    pub source: AdapterSource,
    pub root: Option<PathBuf>,
    pub preload: Vec<String>,
    /// Device slots; 0 serves no adapter (every adapter request fails in the scheduler).
    pub max_active_adapters: u32,
    pub max_lora_rank: u32,
}

impl Settings {
    pub fn from_args(args: &RouterArgs) -> Self {
        Self {
            model_id: args.model_id.clone(),
            served_model_name: args.served_model_name.clone(),
            limits: RequestedLimits {
                max_input_tokens: args.max_input_tokens,
                max_total_tokens: args.max_total_tokens,
                max_batch_prefill_tokens: args.max_batch_prefill_tokens,
            },
            max_batch_total_tokens: args.max_batch_total_tokens,
            max_batch_size: args.max_batch_size,
            max_concurrent_requests: args.max_concurrent_requests,
            api_key: args.api_key.clone().filter(|key| !key.is_empty()),
            adapters: AdapterSettings {
                source: args.adapter_source,
                root: args.adapter_root.clone(),
                preload: args.preload_adapters.clone(),
                max_active_adapters: args.max_active_adapters,
                max_lora_rank: args.max_lora_rank,
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
    #[error("cannot preload adapter: {0}")]
    Preload(AdapterError),
}

/// The names the base model answers to, and the cards `/v1/models` lists.
#[derive(Debug, Clone)]
pub struct ServedModels {
    /// `--served-model-name`, else the model id.
    pub served_name: String,
    /// `--model-id` as given (hub id or directory), also accepted in `model`.
    pub model_id: String,
    pub created: u64,
}

impl ServedModels {
    /// "" (or absent), the served name or the model id select the base model; anything else is
    /// an adapter id.
    pub fn is_base(&self, requested: &str) -> bool {
        requested.is_empty() || requested == self.served_name || requested == self.model_id
    }

    pub fn base_card(&self) -> ModelCard {
        ModelCard::base(
            self.served_name.clone(),
            self.model_id.clone(),
            self.created,
        )
    }
}

/// `GET /info`.
#[derive(Debug, Clone, Serialize)]
pub struct ServerInfo {
    pub model_id: String,
    pub served_model_name: String,
    pub model_type: String,
    pub dtype: String,
    pub device: String,
    pub num_shards: u32,
    pub vocab_size: u32,
    pub max_position_embeddings: u32,
    pub eos_token_ids: Vec<u32>,
    pub limits: ServedLimits,
    pub version: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct ServedLimits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u32,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub block_size: u32,
    pub num_blocks: u32,
}

impl AppState {
    /// Resolves the limits against the model, warms the shard up (it sizes the KV cache) and
    /// starts the scheduler on the blocks it reported.
    pub async fn start(
        shard: Arc<dyn ShardBackend>,
        info: pb::InfoResponse,
        base: ModelAssets,
        settings: Settings,
    ) -> Result<Self, StartupError> {
        let limits = Limits::resolve(settings.limits, info.max_position_embeddings)
            .map_err(StartupError::Limits)?;
        // Before the warmup: a bad --adapter-root should not cost a model warmup.
        let resolver = Resolver::new(settings.adapters.source, settings.adapters.root.as_deref())
            .map_err(StartupError::AdapterRoot)?;
        if let Some(cap) = settings.max_batch_total_tokens {
            if cap < limits.max_total_tokens {
                return Err(StartupError::Limits(format!(
                    "--max-batch-total-tokens ({cap}) must be at least --max-total-tokens ({})",
                    limits.max_total_tokens
                )));
            }
        }
        let warmup = shard
            .warmup(pb::WarmupRequest {
                max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
                max_total_tokens: limits.max_total_tokens,
                max_batch_size: settings.max_batch_size,
                max_batch_total_tokens: settings.max_batch_total_tokens.unwrap_or(0),
                max_active_adapters: settings.adapters.max_active_adapters,
                max_lora_rank: settings.adapters.max_lora_rank,
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
        let scheduler = Scheduler::start(
            shard.clone(),
            SchedulerConfig {
                block_size: warmup.block_size,
                num_blocks: warmup.num_blocks,
                max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
                max_batch_total_tokens,
                max_batch_size: settings.max_batch_size,
                max_concurrent_requests: settings.max_concurrent_requests,
                max_total_tokens: limits.max_total_tokens,
                max_active_adapters: settings.adapters.max_active_adapters,
            },
        );

        // EOS: what the model's generation config says, plus the tokenizer's own.
        let mut eos_token_ids = info.eos_token_ids.clone();
        eos_token_ids.extend_from_slice(base.tokenizer.stop_token_ids());
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();

        let model_id = if settings.model_id.is_empty() {
            info.model_id.clone()
        } else {
            settings.model_id
        };
        let served_name = settings
            .served_model_name
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| model_id.clone());
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
                max_batch_total_tokens,
                max_batch_size: settings.max_batch_size,
                max_concurrent_requests: settings.max_concurrent_requests,
                block_size: warmup.block_size,
                num_blocks: warmup.num_blocks,
            },
            version: env!("CARGO_PKG_VERSION"),
        };
        let base = Arc::new(base);
        let backend: Arc<dyn AdapterBackend> = Arc::new(ServingBackend {
            shard: shard.clone(),
            scheduler: scheduler.clone(),
        });
        let adapters = AdapterRegistry::new(backend, base.clone());
        preload(&adapters, &resolver, &settings.adapters.preload).await?;
        Ok(Self {
            scheduler,
            shard,
            validator: Arc::new(Validator {
                limits,
                vocab_size: info.vocab_size,
                eos_token_ids,
            }),
            base,
            models: Arc::new(ServedModels {
                served_name,
                model_id,
                created: crate::openai::common::unix_now(),
            }),
            info: Arc::new(server_info),
            metrics: Arc::new(Metrics::default()),
            api_key: settings.api_key.map(Arc::from),
            adapters,
            resolver: Arc::new(resolver),
        })
    }

    /// The adapter id ("" for the base model) and the tokenizer/template a request's `model`
    /// runs with. An adapter not loaded yet is looked up in `adapter_source` (else
    /// `--adapter-source`) and loaded; this waits for that load, and only this request does.
    pub async fn resolve_model(
        &self,
        requested: Option<&str>,
        adapter_source: Option<&str>,
    ) -> Result<(String, Arc<ModelAssets>), ApiError> {
        let source = adapter_source
            .map(AdapterSource::parse)
            .transpose()
            .map_err(ApiError::from)?;
        let requested = requested.unwrap_or_default();
        if self.models.is_base(requested) {
            return Ok((String::new(), self.base.clone()));
        }
        let entry = self
            .adapters
            .acquire(requested, || self.resolver.resolve(requested, source))
            .await?;
        Ok((entry.id.clone(), entry.assets.clone()))
    }
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
