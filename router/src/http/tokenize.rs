//! `POST /tokenize` and `POST /detokenize` (vLLM's token utilities): resolve `model` as the
//! generation endpoints do, then use that model's tokenizer and chat template (an adapter's
//! own when it ships them). No shard call beyond loading an adapter on first use.

use axum::extract::State;
use axum::{Extension, Json};
use serde_json::Value;

use super::json::{typed, OpenAiJson, RequestBody};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};
use crate::tenants::Caller;
use crate::validation::{tokenize_ids, vocabulary_ids, ValidationError};

impl RequestBody for TokenizeRequest {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

impl RequestBody for DetokenizeRequest {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        typed(value)
    }
}

pub async fn tokenize(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    OpenAiJson(request): OpenAiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let assets = state
        .infer
        .models()
        .resolve(
            &caller,
            request.model.as_deref(),
            request.adapter_source.as_deref(),
        )
        .await?
        .assets;
    let return_token_strs = request.return_token_strs == Some(true);
    let max_model_len = state.info.limits.max_total_tokens;
    let tokens = tokenize_ids(&assets, request, max_model_len).await?;
    // The vocabulary's own spelling of each token (e.g. `Ġword`), as vLLM returns it.
    let token_strs = return_token_strs.then(|| {
        let tokenizer = assets.tokenizer.inner();
        tokens
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len,
        tokens,
        token_strs,
    }))
}

pub async fn detokenize(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    OpenAiJson(request): OpenAiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let assets = state
        .infer
        .models()
        .resolve(
            &caller,
            request.model.as_deref(),
            request.adapter_source.as_deref(),
        )
        .await?
        .assets;
    let ids = vocabulary_ids(&assets.tokenizer, request.tokens)?;
    // Special tokens are kept, as vLLM and `tokenizer.decode` do by default.
    let prompt = assets
        .tokenizer
        .decode_off_runtime(ids, false)
        .await
        .map_err(ValidationError::from)?;
    Ok(Json(DetokenizeResponse { prompt }))
}
