//! `POST /v1/embeddings`: the body read, `Infer::embed` run on its inputs (see `core::embed`),
//! and the vectors answered in input order, as floats or OpenAI's base64.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use serde_json::Value;

use super::ignored_fields::name_ignored_fields;
use super::json::{typed, OpenAiJson, RequestBody};
use super::state::AppState;
use crate::core::{Embedded, EmbeddingInputs};
use crate::error::ApiError;
use crate::openai::embeddings::{
    Embedding, EmbeddingVector, EmbeddingsRequest, EmbeddingsResponse, EmbeddingsUsage, EMBEDDINGS,
};
use crate::openai::fields::check_fields_of;
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
    let EmbeddingsBody { request, ignored } = body;
    let base64 = request.encoding_format.as_deref() == Some("base64");
    let Embedded {
        vectors,
        prompt_tokens,
        model,
    } = state
        .infer
        .embed(
            &caller,
            EmbeddingInputs {
                model: request.model,
                adapter_source: request.adapter_source,
                input: request.input,
                add_special_tokens: request.add_special_tokens.unwrap_or(true),
            },
        )
        .await?;
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
        model,
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
