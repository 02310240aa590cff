//! Embeddings (`/v1/embeddings`): each input checked and tokenized with the tokenizer its
//! `model` resolves to (an adapter's own included), then run as an embedding request: one pass
//! over its prompt in a Prefill beside the generation traffic, holding no decode slot
//! (`scheduler::GenerationRequest::embedding`). The vectors come back in input order.

use serde_json::Value;
use tracing::Instrument;

use super::infer::{request_scope, Infer};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::{EventReceiver, FinishReason, GenerationRequest};
use crate::telemetry;
use crate::tenants::Caller;

/// What an embeddings request asks for, as its body gave it.
pub struct EmbeddingInputs {
    pub model: Option<String>,
    pub adapter_source: Option<String>,
    /// A string, a list of strings, token ids, or lists of token ids.
    pub input: Option<Value>,
    pub add_special_tokens: bool,
}

/// The vectors of one embeddings request.
pub struct Embedded {
    /// One per input, in input order.
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: u32,
    /// What the response reports as `model`.
    pub model: String,
}

impl Infer {
    /// The embedding of each input. The request is admitted as one; each input is one whole
    /// Prefill that holds no batch slot. Its tokens are charged to `caller` once admitted, as a
    /// generation's prompt is.
    pub async fn embed(
        &self,
        caller: &Caller,
        request: EmbeddingInputs,
    ) -> Result<Embedded, ApiError> {
        self.check_available()?;
        if let Some(reason) = &self.embeddings_refusal {
            return Err(ApiError::BadRequestBody {
                message: format!("this model serves no embeddings: {reason}"),
                param: Some("model".to_owned()),
                code: "embeddings_unavailable",
            });
        }
        let model = self
            .models()
            .resolve(
                caller,
                request.model.as_deref(),
                request.adapter_source.as_deref(),
            )
            .await?;
        let inputs = self
            .validator
            .embedding_inputs(&model.assets, request.input, request.add_special_tokens)
            .instrument(telemetry::span("validate"))
            .await?;
        let prompt_tokens: u32 = inputs.iter().map(|ids| ids.len() as u32).sum();
        let vectors = self
            .run_embeddings(caller, &model.adapter_id, model.adapter_rank, inputs)
            .await?;
        Ok(Embedded {
            vectors,
            prompt_tokens,
            model: self.models().response_model(request.model),
        })
    }

    async fn run_embeddings(
        &self,
        caller: &Caller,
        adapter_id: &str,
        adapter_rank: u32,
        inputs: Vec<Vec<u32>>,
    ) -> Result<Vec<Vec<f32>>, ApiError> {
        let tokens: u64 = inputs.iter().map(|ids| ids.len() as u64).sum();
        let count = inputs.len() as u64;
        let scope = request_scope(caller, None);
        let requests = inputs
            .into_iter()
            .map(|ids| GenerationRequest {
                scope: scope.clone(),
                ..GenerationRequest::embedding(ids, adapter_id, adapter_rank)
            })
            .collect();
        let receivers = self.scheduler.submit_all(requests)?;
        caller.charge(tokens, 0);
        Metrics::add(&self.metrics.prompt_tokens_total, tokens);
        Metrics::add(&self.metrics.embedding_tokens_total, tokens);
        let vectors = tokio::select! {
            vectors = collect_embeddings(receivers) => vectors,
            () = self.cutoff.fired() => {
                self.cutoff.record_cut();
                return Err(ApiError::GracePeriodOver);
            }
        };
        match vectors {
            Ok(vectors) => {
                Metrics::add(&self.metrics.embedding_inputs_total, count);
                Ok(vectors)
            }
            Err(error) => {
                Metrics::add(&self.metrics.requests_failed_total, 1);
                self.check_available()?;
                Err(error)
            }
        }
    }
}

/// Each input's embedding, in input order; the first failure fails the request (dropping the
/// other receivers cancels what has not run yet).
async fn collect_embeddings(receivers: Vec<EventReceiver>) -> Result<Vec<Vec<f32>>, ApiError> {
    let mut vectors = Vec::with_capacity(receivers.len());
    for mut receiver in receivers {
        match receiver.recv().await {
            Some(Ok(event)) if event.finish == Some(FinishReason::Embedded) => {
                vectors.push(event.embedding);
            }
            Some(Ok(_)) | None => {
                return Err(ApiError::Internal(
                    "the scheduler ended an embedding request without its embedding".to_owned(),
                ))
            }
            Some(Err(error)) => return Err(error.into()),
        }
    }
    Ok(vectors)
}
