//! Everything the handlers share, built once at start-up: the scheduler handle, the shard (for
//! `/health`), the validator, the base model's tokenizer and template, and what `/info` and
//! `/v1/models` report.

use std::sync::Arc;

use serde::Serialize;

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
    /// "" (or absent), the served name or the model id select the base model; adapters will
    /// be resolved here too (issue 3), which is why this returns the adapter id.
    pub fn resolve(&self, requested: Option<&str>) -> Result<String, ApiError> {
        match requested.unwrap_or_default() {
            "" => Ok(String::new()),
            name if name == self.served_name || name == self.model_id => Ok(String::new()),
            other => Err(ApiError::ModelNotFound(other.to_owned())),
        }
    }

    pub fn cards(&self) -> Vec<ModelCard> {
        vec![ModelCard::base(
            self.served_name.clone(),
            self.model_id.clone(),
            self.created,
        )]
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
                // Adapter slots come with multi-LoRA serving (issue 3).
                max_active_adapters: 0,
                max_lora_rank: 0,
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
        Ok(Self {
            scheduler,
            shard,
            validator: Arc::new(Validator {
                limits,
                vocab_size: info.vocab_size,
                eos_token_ids,
            }),
            base: Arc::new(base),
            models: Arc::new(ServedModels {
                served_name,
                model_id,
                created: crate::openai::common::unix_now(),
            }),
            info: Arc::new(server_info),
            metrics: Arc::new(Metrics::default()),
            api_key: settings.api_key.map(Arc::from),
        })
    }

    /// The adapter id and the tokenizer/template a request's `model` runs with.
    pub fn resolve_model(
        &self,
        requested: Option<&str>,
    ) -> Result<(String, Arc<ModelAssets>), ApiError> {
        let adapter_id = self.models.resolve(requested)?;
        Ok((adapter_id, self.base.clone()))
    }
}
