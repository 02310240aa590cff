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
    #[schema(value_type = Vec<super::field_schemas::ChatMessage>, required = true, min_items = 1)]
    pub messages: Option<Vec<Value>>,
    /// Handed to the chat template as `tools`, as transformers' `apply_chat_template` does;
    /// replies are constrained to and read for calls of them (docs/tool-calling.md).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// `"none"`, `"auto"` (the default with tools), `"required"`, or
    /// `{"type": "function", "function": {"name": ...}}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Whether a reply may hold more than one call (default true).
    #[schema(value_type = Option<bool>)]
    pub parallel_tool_calls: Option<Value>,
    /// Legacy form of `tools`; answered with `message.function_call`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Value>,
    /// Legacy form of `tool_choice`: `"none"`, `"auto"` or `{"name": ...}`.
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<Value>,
    /// Report each generated token's logprob.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token, 0..=20.
    pub top_logprobs: Option<i64>,
    /// Extra variables for the chat template (vLLM's extension), e.g. `{"enable_thinking":
    /// false}`; names the request sets itself (`messages`, `tools`, ...) are refused.
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Value>,
}

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
    /// Null when a reply of tool calls has no text.
    #[schema(required = true)]
    pub content: Option<String>,
    #[schema(required = true)]
    pub refusal: Option<String>,
    /// A thinking model's reasoning (its text between `<think>` and `</think>`), null when the
    /// reply has none; absent for models without a reasoning parser (docs/reasoning.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, nullable = true)]
    pub reasoning_content: Option<Option<String>>,
    /// The calls of a reply to a request with `tools`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call of a reply to a request with the legacy `functions`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<FunctionCall>,
}

impl AssistantMessage {
    pub fn new(content: Option<String>) -> Self {
        Self {
            role: "assistant",
            content,
            refusal: None,
            reasoning_content: None,
            tool_calls: None,
            function_call: None,
        }
    }
}

/// One call in `message.tool_calls`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    #[schema(value_type = String, pattern = "^function$")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

/// A function and its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments, a JSON object as text.
    pub arguments: String,
}

/// One piece of a streamed call in `delta.tool_calls`: the first of a call has its `id`,
/// `type` and `function.name` (and `arguments: ""`), the later ones `function.arguments` pieces.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, pattern = "^function$")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

/// A piece of a streamed function call.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
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
    /// A piece of a thinking model's reasoning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    /// The legacy `functions` form of a streamed call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_call: Option<FunctionCallDelta>,
}
