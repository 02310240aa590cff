//! `POST /v1/embeddings`: resolve `model` as the generation endpoints do (an adapter's own
//! tokenizer included), check and tokenize each input, and have `Infer` run each as an
//! embedding request: one pass over its prompt in a Prefill beside the generation traffic,
//! holding no decode slot (`scheduler::GenerationRequest::embed`). The answer lists the
//! vectors in input order.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use serde_json::Value;
use tracing::Instrument;

use super::ignored_fields::name_ignored_fields;
use super::json::{typed, OpenAiJson, RequestBody};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::embeddings::{
    Embedding, EmbeddingVector, EmbeddingsRequest, EmbeddingsResponse, EmbeddingsUsage, EMBEDDINGS,
};
use crate::openai::fields::check_fields_of;
use crate::telemetry;
use crate::tenants::Caller;

pub struct EmbeddingsBody {
    request: EmbeddingsRequest,
    /// Fields the table does not know: accepted without effect, named in the response.
    ignored: Vec<String>,
}

impl RequestBody for EmbeddingsBody {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        let ignored = match &value {
            Value::Object(body) => check_fields_of(&[EMBEDDINGS], body)?,
            _ => Vec::new(),
        };
        Ok(Self {
            request: typed(value)?,
            ignored,
        })
    }
}

pub async fn create_embeddings(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    OpenAiJson(body): OpenAiJson<EmbeddingsBody>,
) -> Result<Response, ApiError> {
    state.infer.check_available()?;
    let EmbeddingsBody { request, ignored } = body;
    if let Some(reason) = &state.info.embeddings.unavailable {
        return Err(ApiError::BadRequestBody {
            message: format!("this model serves no embeddings: {reason}"),
            param: Some("model".to_owned()),
            code: "embeddings_unavailable",
        });
    }
    let model = state
        .resolve_model(
            &caller,
            request.model.as_deref(),
            request.adapter_source.as_deref(),
        )
        .await?;
    let inputs = state
        .validator
        .embedding_inputs(
            &model.assets,
            request.input,
            request.add_special_tokens.unwrap_or(true),
        )
        .instrument(telemetry::span("validate"))
        .await?;
    let prompt_tokens: u32 = inputs.iter().map(|ids| ids.len() as u32).sum();
    let vectors = state
        .infer
        .embed(&caller, &model.adapter_id, model.adapter_rank, inputs)
        .await?;
    let base64 = request.encoding_format.as_deref() == Some("base64");
    let data = vectors
        .into_iter()
        .zip(0..)
        .map(|(vector, index)| Embedding {
            object: "embedding",
            index,
            embedding: if base64 {
                EmbeddingVector::Base64(encode(&vector))
            } else {
                EmbeddingVector::Float(vector)
            },
        })
        .collect();
    let response = Json(EmbeddingsResponse {
        object: "list",
        data,
        model: super::response_model(&state, request.model),
        usage: EmbeddingsUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    })
    .into_response();
    Ok(name_ignored_fields(response, &ignored))
}

/// OpenAI's `base64` format: the vector's little-endian float32 bytes, base64-encoded.
fn encode(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
