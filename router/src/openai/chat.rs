//! `POST /v1/chat/completions`: request fields of its own and the response/chunk objects.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::common::{FinishReason, ObjectHeader, Usage};
use super::logprobs::{ChatLogprobs, PromptLogprobs};

/// The chat-only request fields; the shared ones are in `GenerationParams`.
///
/// Messages stay JSON values: the chat template receives them as the client sent them
/// (`name`, `tool_calls`, ... included), after validation normalized `role` and `content`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[schema(
    description = "The chat-only request fields. Messages reach the chat template as \
                        sent, keys not listed here included."
)]
pub struct ChatFields {
    #[schema(value_type = Vec<super::schema::ChatMessage>, required = true, min_items = 1)]
    pub messages: Option<Vec<Value>>,
    /// Handed to the chat template as `tools`, as transformers' `apply_chat_template` does.
    pub tools: Option<Value>,
    /// Report each generated token's logprob.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token, 0..=20.
    pub top_logprobs: Option<i64>,
}

/// Roles OpenAI's schema defines for request messages.
pub const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

pub const OBJECT: &str = "chat.completion";
pub const CHUNK_OBJECT: &str = "chat.completion.chunk";
pub const ID_PREFIX: &str = "chatcmpl-";

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionResponse {
    #[serde(flatten)]
    pub header: ObjectHeader,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// With `return_token_ids` (vLLM's extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// With `logprobs: true`.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: FinishReason,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `prompt_logprobs` (vLLM's extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    #[schema(value_type = String, pattern = "^assistant$")]
    pub role: &'static str,
    pub content: String,
    #[schema(required = true)]
    pub refusal: Option<String>,
}

impl AssistantMessage {
    pub fn new(content: String) -> Self {
        Self {
            role: "assistant",
            content,
            refusal: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    #[serde(flatten)]
    pub header: ObjectHeader,
    /// Empty in the final usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// With `return_token_ids`, on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    /// With `logprobs: true`: the entries of this chunk's tokens.
    #[schema(required = true)]
    pub logprobs: Option<ChatLogprobs>,
    /// Null until the choice's last chunk.
    #[schema(required = true)]
    pub finish_reason: Option<FinishReason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `prompt_logprobs`, on a chunk of its own before the choice's text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// `{}` on the finish chunk, `{"role": "assistant", "content": ""}` on the first one.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, pattern = "^assistant$")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}
