//! `POST /v1/chat/completions`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::generation::{collect_choices, start_choices};
use super::json::{typed, OpenAiJson, RequestBody};
use super::sse::{sse_response, ChunkFormat, StreamPlan};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatFields, CHUNK_OBJECT, ID_PREFIX, OBJECT,
};
use crate::openai::common::{random_id, unix_now, FinishReason, GenerationParams, Usage};

pub struct ChatCompletionRequest {
    pub fields: ChatFields,
    pub params: GenerationParams,
}

impl RequestBody for ChatCompletionRequest {
    fn from_json(value: &Value) -> Result<Self, ApiError> {
        Ok(Self {
            fields: typed(value)?,
            params: typed(value)?,
        })
    }
}

pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let ChatCompletionRequest { fields, params } = request;
    let (adapter_id, assets) = state
        .resolve_model(params.model.as_deref(), params.adapter_source.as_deref())
        .await?;
    let valid = state
        .validator
        .chat(&assets, &adapter_id, fields, &params)
        .await?;
    let options = valid.options;
    let prompt_token_ids = options.return_token_ids.then(|| {
        valid
            .choices
            .first()
            .map(|choice| choice.input_ids.clone())
            .unwrap_or_default()
    });
    let choices = start_choices(
        &state.scheduler,
        &state.metrics,
        &assets.tokenizer,
        valid.choices,
        &options.stop,
    )?;
    let chunks = ChatChunks {
        id: random_id(ID_PREFIX),
        created: unix_now(),
        model: super::response_model(&state, params.model),
        prompt_token_ids,
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
    let response = ChatCompletionResponse {
        id: chunks.id,
        object: OBJECT,
        created: chunks.created,
        model: chunks.model,
        choices: outputs
            .into_iter()
            .zip(0..)
            .map(|(output, index)| ChatChoice {
                index,
                message: AssistantMessage::new(output.text),
                logprobs: None,
                finish_reason: output.finish_reason,
                token_ids: options.return_token_ids.then_some(output.token_ids),
            })
            .collect(),
        usage: Usage::new(valid.prompt_tokens, completion_tokens),
        prompt_token_ids: chunks.prompt_token_ids,
    };
    Ok(Json(response).into_response())
}

/// Chat chunks: `object: "chat.completion.chunk"`, text in `delta.content`.
struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    /// Sent on the opening chunk of choice 0.
    prompt_token_ids: Option<Vec<u32>>,
}

impl ChatChunks {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: CHUNK_OBJECT,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            prompt_token_ids: None,
        }
    }

    fn choice(
        index: u32,
        delta: ChatDelta,
        finish_reason: Option<FinishReason>,
        token_ids: Option<Vec<u32>>,
    ) -> ChatChunkChoice {
        ChatChunkChoice {
            index,
            delta,
            logprobs: None,
            finish_reason,
            token_ids,
        }
    }
}

impl ChunkFormat for ChatChunks {
    type Chunk = ChatCompletionChunk;

    fn opening(&mut self, index: u32) -> Option<ChatCompletionChunk> {
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
        };
        let mut chunk = self.chunk(vec![Self::choice(index, delta, None, None)], None);
        if index == 0 {
            chunk.prompt_token_ids = self.prompt_token_ids.clone();
        }
        Some(chunk)
    }

    fn text(
        &mut self,
        index: u32,
        text: String,
        token_ids: Option<Vec<u32>>,
    ) -> ChatCompletionChunk {
        let delta = ChatDelta {
            role: None,
            content: Some(text),
        };
        self.chunk(vec![Self::choice(index, delta, None, token_ids)], None)
    }

    fn finish(
        &mut self,
        index: u32,
        reason: FinishReason,
        token_ids: Option<Vec<u32>>,
    ) -> ChatCompletionChunk {
        self.chunk(
            vec![Self::choice(
                index,
                ChatDelta::default(),
                Some(reason),
                token_ids,
            )],
            None,
        )
    }

    fn usage(&mut self, usage: Usage) -> ChatCompletionChunk {
        self.chunk(Vec::new(), Some(usage))
    }
}
