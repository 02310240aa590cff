//! Everything the handlers share (built once by `crate::startup`): the scheduler handle, the
//! shard (for `/health`), the validator, the base model's tokenizer and template, the adapter
//! registry, and what `/info` and `/v1/models` report; and the one per-request step that reads
//! them all, resolving a request's `model` to the adapter and assets it runs with.

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use super::cutoff::Cutoff;
use super::infer::Infer;
use crate::adapters::{AdapterRegistry, AdapterSource, Resolver};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::models::ModelCard;
use crate::scheduler::Scheduler;
use crate::shard::ShardBackend;
use crate::tenants::{Caller, Tenants};
use crate::validation::{ModelAssets, Validator};

#[derive(Clone)]
pub struct AppState {
    /// What the serving handlers go through to run requests.
    pub infer: Infer,
    /// For the load figures of `/metrics` and the shutdown's drain.
    pub scheduler: Scheduler,
    /// For `/health`.
    pub shard: Arc<dyn ShardBackend>,
    pub validator: Arc<Validator>,
    pub base: Arc<ModelAssets>,
    pub models: Arc<ServedModels>,
    pub info: Arc<ServerInfo>,
    pub metrics: Arc<Metrics>,
    /// The API keys (`--api-key`, `--api-keys-file`) and what each may do; open without.
    pub tenants: Arc<Tenants>,
    /// `--metrics-open`: /metrics answers without a key even when keys are configured.
    pub metrics_open: bool,
    /// Loaded adapters, and where ids not loaded yet are looked up.
    pub adapters: AdapterRegistry,
    pub resolver: Arc<Resolver>,
    /// Fired when the grace period of a shutdown runs out.
    pub cutoff: Cutoff,
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
#[derive(Debug, Clone, Serialize, ToSchema)]
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
    /// The tool-call format of the base model's replies (`--tool-call-parser`, else detected
    /// from its chat template, else hermes); an adapter with its own template may differ.
    #[schema(value_type = String)]
    pub tool_call_parser: &'static str,
    /// How the base model's chat replies are split into `reasoning_content` and `content`
    /// (`--reasoning-parser`, else detected from its chat template); null: no split. An adapter
    /// with its own template may differ.
    #[schema(value_type = Option<String>)]
    pub reasoning_parser: Option<&'static str>,
    pub embeddings: EmbeddingsInfo,
    #[schema(value_type = String)]
    pub version: &'static str,
}

/// What `/v1/embeddings` returns for this model (from the shard's `Info`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingsInfo {
    /// Width of each embedding: the model's hidden size.
    pub dimensions: u32,
    /// How the last hidden states are pooled, in words (the model's sentence-transformers
    /// files, else the last token, L2-normalized).
    pub pooling: String,
    /// Why this model serves no embeddings; null when it does.
    pub unavailable: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ServedLimits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
    pub max_batch_total_tokens: u32,
    pub max_batch_size: u32,
    pub max_concurrent_requests: u32,
    pub max_choices_per_request: u32,
    pub max_request_kv_share: f64,
    /// `--max-logprob-entries`, resolved.
    pub max_logprob_entries: u64,
    pub max_stop_sequences: u32,
    pub preemption_wait_ms: u64,
    /// 0: off.
    pub max_queue_wait_secs: u64,
    pub block_size: u32,
    pub num_blocks: u32,
}

/// What a request's `model` runs with (`AppState::resolve_model`).
pub struct ResolvedModel {
    /// "" for the base model.
    pub adapter_id: String,
    /// The adapter's LoRA rank, which picks its slot class; 0 for the base model.
    pub adapter_rank: u32,
    /// The tokenizer and chat template.
    pub assets: Arc<ModelAssets>,
}

impl AppState {
    /// The adapter (none for the base model) and the tokenizer/template a request's `model`
    /// runs with. An adapter not loaded yet is looked up in `adapter_source` (else
    /// `--adapter-source`) and loaded; this waits for that load, and only this request does.
    ///
    /// A model the caller's key may not use is answered exactly as a missing one, before any
    /// lookup; and for a key that cannot use every adapter, a missing adapter is answered
    /// without the lookup's detail, so the two cannot be told apart.
    pub async fn resolve_model(
        &self,
        caller: &Caller,
        requested: Option<&str>,
        adapter_source: Option<&str>,
    ) -> Result<ResolvedModel, ApiError> {
        let source = adapter_source
            .map(AdapterSource::parse)
            .transpose()
            .map_err(ApiError::from)?;
        let requested = requested.unwrap_or_default();
        let not_found = || ApiError::ModelNotFound(requested.to_owned());
        if self.models.is_base(requested) {
            if !caller.may_use_base_model() {
                return Err(not_found());
            }
            return Ok(ResolvedModel {
                adapter_id: String::new(),
                adapter_rank: 0,
                assets: self.base.clone(),
            });
        }
        if !caller.may_use_adapter(requested) {
            return Err(not_found());
        }
        let entry = self
            .adapters
            .acquire(requested, || self.resolver.resolve(requested, source))
            .await
            .map_err(|error| {
                if caller.is_restricted() && error.is_not_found() {
                    not_found()
                } else {
                    ApiError::from(error)
                }
            })?;
        Ok(ResolvedModel {
            adapter_id: entry.id.clone(),
            adapter_rank: entry.rank,
            assets: entry.assets.clone(),
        })
    }
}
