//! The one request path of the generation endpoints (`/v1/chat/completions`,
//! `/v1/completions`): resolve `model` → validate → schedule every choice → stream chunks as
//! SSE or collect one JSON response. What differs per endpoint is small and sits behind
//! `Endpoint`: the request fields it reads (which say how its prompts are built, see
//! `PromptSource`), and how its chunks (`ChunkFormat`) and its final response are spelled.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::generation::{collect_choices, start_choices};
use super::json::{typed, OpenAiJson, RequestBody};
use super::sse::{sse_response, ChunkFormat, StreamPlan};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::common::{FinishReason, GenerationParams, Usage};
use crate::openai::fields::{check_fields, EndpointFields};
use crate::validation::PromptSource;

/// One generation endpoint; a value formats one request's chunks and response.
pub trait Endpoint: ChunkFormat + Sized {
    /// The request fields only this endpoint reads (`messages`, `prompt`).
    type Fields: PromptSource + EndpointFields + DeserializeOwned + 'static;
    type Response: Serialize;

    /// `model` is what the response reports; `prompt_token_ids` holds each choice's prompt
    /// ids when the client asked for token ids.
    fn new(model: String, prompt_token_ids: Option<Vec<Vec<u32>>>) -> Self;

    /// The non-streamed response, choices in index order.
    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> Self::Response;
}

/// A choice run to its end, for the non-streamed response.
pub struct FinishedChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: FinishReason,
    /// The generated ids, only when the client asked for them.
    pub token_ids: Option<Vec<u32>>,
}

/// An endpoint's request body: its own fields and the shared generation parameters, both read
/// from the same JSON object (see `GenerationParams` for why they are not flattened).
pub struct GenerationBody<F> {
    fields: F,
    params: GenerationParams,
}

impl<F: DeserializeOwned + EndpointFields> RequestBody for GenerationBody<F> {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        // Fields refused or unknown first: the typed structs below would skip them silently.
        if let Value::Object(body) = value {
            check_fields(F::FIELDS, body)?;
        }
        // The endpoint's own fields first: when both are wrong, `messages` or `prompt` is named.
        Ok(Self {
            fields: typed(value)?,
            params: typed(value)?,
        })
    }
}

/// The axum handler of endpoint `E`.
pub async fn generate<E: Endpoint>(
    State(state): State<AppState>,
    OpenAiJson(body): OpenAiJson<GenerationBody<E::Fields>>,
) -> Result<Response, ApiError> {
    if state.shard.is_unavailable() {
        return Err(ApiError::shard_gone());
    }
    let GenerationBody { fields, params } = body;
    let (adapter_id, assets) = state
        .resolve_model(params.model.as_deref(), params.adapter_source.as_deref())
        .await?;
    let valid = state
        .validator
        .validate(&assets, &adapter_id, fields, &params)
        .await?;
    let options = valid.options;
    let prompt_token_ids = options.return_token_ids.then(|| {
        valid
            .choices
            .iter()
            .map(|choice| choice.input_ids.clone())
            .collect()
    });
    let choices = start_choices(
        &state.scheduler,
        &state.shard,
        &state.metrics,
        &assets.tokenizer,
        valid.choices,
        &options.stop,
    )?;
    let format = E::new(
        super::response_model(&state, params.model),
        prompt_token_ids,
    );
    if options.stream {
        let plan = StreamPlan {
            choices,
            prompt_tokens: valid.prompt_tokens,
            include_usage: options.include_usage,
            return_token_ids: options.return_token_ids,
            cutoff: state.cutoff.clone(),
        };
        return Ok(sse_response(format, plan).into_response());
    }
    let outputs = tokio::select! {
        outputs = collect_choices(choices) => outputs?,
        () = state.cutoff.fired() => {
            state.cutoff.record_cut();
            return Err(ApiError::GracePeriodOver);
        }
    };
    let completion_tokens = outputs.iter().map(|output| output.completion_tokens).sum();
    let finished = outputs
        .into_iter()
        .zip(0..)
        .map(|(output, index)| FinishedChoice {
            index,
            text: output.text,
            finish_reason: output.finish_reason,
            token_ids: options.return_token_ids.then_some(output.token_ids),
        })
        .collect();
    let response = format.response(finished, Usage::new(valid.prompt_tokens, completion_tokens));
    Ok(Json(response).into_response())
}
