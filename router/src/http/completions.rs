//! `POST /v1/completions`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::generation::{collect_choices, start_choices};
use super::json::{typed, OpenAiJson, RequestBody};
use super::sse::{sse_response, ChunkFormat, StreamPlan};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::common::{random_id, unix_now, FinishReason, GenerationParams, Usage};
use crate::openai::completions::{
    CompletionChoice, CompletionFields, CompletionResponse, ID_PREFIX, OBJECT,
};

pub struct CompletionRequest {
    pub fields: CompletionFields,
    pub params: GenerationParams,
}

impl RequestBody for CompletionRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        Ok(Self {
            fields: typed(value)?,
            params: typed(value)?,
        })
    }
}

pub async fn completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let CompletionRequest { fields, params } = request;
    let (adapter_id, assets) = state
        .resolve_model(params.model.as_deref(), params.adapter_source.as_deref())
        .await?;
    let valid = state
        .validator
        .completion(&assets, &adapter_id, fields, &params)
        .await?;
    let options = valid.options;
    // Each choice's prompt, for `return_token_ids`.
    let prompt_token_ids: Vec<Vec<u32>> = if options.return_token_ids {
        valid
            .choices
            .iter()
            .map(|choice| choice.input_ids.clone())
            .collect()
    } else {
        Vec::new()
    };
    let choices = start_choices(
        &state.scheduler,
        &state.metrics,
        &assets.tokenizer,
        valid.choices,
        &options.stop,
    )?;
    let mut chunks = CompletionChunks {
        id: random_id(ID_PREFIX),
        created: unix_now(),
        model: super::response_model(&state, params.model),
        prompt_token_ids: prompt_token_ids.into_iter().map(Some).collect(),
    };
    if options.stream {
        let plan = StreamPlan {
            choices,
            prompt_tokens: valid.prompt_tokens,
            include_usage: options.include_usage,
            return_token_ids: options.return_token_ids,
        };
        return Ok(sse_response(chunks, plan).into_response());
    }
    let outputs = collect_choices(choices).await?;
    let completion_tokens = outputs.iter().map(|output| output.completion_tokens).sum();
    let choices = outputs
        .into_iter()
        .zip(0..)
        .map(|(output, index)| CompletionChoice {
            index,
            text: output.text,
            logprobs: None,
            finish_reason: Some(output.finish_reason),
            prompt_token_ids: chunks.take_prompt_ids(index),
            token_ids: options.return_token_ids.then_some(output.token_ids),
        })
        .collect();
    let response = CompletionResponse {
        id: chunks.id,
        object: OBJECT,
        created: chunks.created,
        model: chunks.model,
        choices,
        usage: Some(Usage::new(valid.prompt_tokens, completion_tokens)),
    };
    Ok(Json(response).into_response())
}

/// Completions chunks share the response's shape (`object: "text_completion"`).
struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    /// Per choice, until sent with its first chunk (empty without `return_token_ids`).
    prompt_token_ids: Vec<Option<Vec<u32>>>,
}

impl CompletionChunks {
    fn take_prompt_ids(&mut self, index: u32) -> Option<Vec<u32>> {
        self.prompt_token_ids
            .get_mut(index as usize)
            .and_then(Option::take)
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: OBJECT,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    fn choice_chunk(
        &mut self,
        index: u32,
        text: String,
        finish_reason: Option<FinishReason>,
        token_ids: Option<Vec<u32>>,
    ) -> CompletionResponse {
        let choice = CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason,
            prompt_token_ids: self.take_prompt_ids(index),
            token_ids,
        };
        self.chunk(vec![choice], None)
    }
}

impl ChunkFormat for CompletionChunks {
    type Chunk = CompletionResponse;

    fn opening(&mut self, _index: u32) -> Option<CompletionResponse> {
        None
    }

    fn text(
        &mut self,
        index: u32,
        text: String,
        token_ids: Option<Vec<u32>>,
    ) -> CompletionResponse {
        self.choice_chunk(index, text, None, token_ids)
    }

    fn finish(
        &mut self,
        index: u32,
        reason: FinishReason,
        token_ids: Option<Vec<u32>>,
    ) -> CompletionResponse {
        self.choice_chunk(index, String::new(), Some(reason), token_ids)
    }

    fn usage(&mut self, usage: Usage) -> CompletionResponse {
        self.chunk(Vec::new(), Some(usage))
    }
}
