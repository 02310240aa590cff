//! vLLM's token utilities, `POST /tokenize` and `POST /detokenize`: request and response
//! bodies field for field as vLLM names them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `/tokenize`: either `prompt` (a text tokenized as is) or `messages` (rendered with the chat
/// template first). Every field is optional and `null` means absent; fields not listed here
/// are ignored, as on the generation endpoints.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    /// Selects the base model or an adapter, as on the generation endpoints.
    pub model: Option<String>,
    pub prompt: Option<String>,
    #[schema(value_type = Option<Vec<super::field_schemas::ChatMessage>>)]
    pub messages: Option<Vec<Value>>,
    /// Handed to the chat template, as on `/v1/chat/completions`.
    pub tools: Option<Value>,
    /// Chat only; default true.
    pub add_generation_prompt: Option<bool>,
    /// Chat only: extra variables for the chat template, as on `/v1/chat/completions`.
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Value>,
    /// Default true with `prompt` (BOS and the like), false with `messages` (the template
    /// already wrote them).
    pub add_special_tokens: Option<bool>,
    /// Also return each token's string (`token_strs`).
    pub return_token_strs: Option<bool>,
    /// Extension: where an adapter id in `model` is looked up, `hub`, `local` or `s3`.
    pub adapter_source: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    /// The most tokens a sequence may hold, prompt and completion together
    /// (`--max-total-tokens`).
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

/// `/detokenize`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    /// Signed, so that a negative id is refused as out of the vocabulary with `param: tokens`
    /// rather than as a type error.
    #[schema(value_type = Vec<i64>, required = true)]
    pub tokens: Option<Vec<i64>>,
    pub adapter_source: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
