//! What the handlers share (built once by `crate::startup`): `Infer`, the core every serving
//! handler calls; what `/info` reports; and the API keys the authentication layer checks.

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use crate::core::Infer;
use crate::tenants::Tenants;

#[derive(Clone)]
pub struct AppState {
    /// What every serving handler goes through.
    pub infer: Infer,
    /// What `/info` reports, and the limits the body reader applies.
    pub info: Arc<ServerInfo>,
    /// The API keys (`--api-key`, `--api-keys-file`) and what each may do; open without.
    pub tenants: Arc<Tenants>,
    /// `--metrics-open`: /metrics answers without a key even when keys are configured.
    pub metrics_open: bool,
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
