//! `POST /v1/completions`: request fields of its own and the response object, which OpenAI
//! uses for streamed chunks too.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::common::{FinishReason, ObjectHeader, Usage};
use super::logprobs::{CompletionLogprobs, PromptLogprobs};

/// The completions-only request fields; the shared ones are in `GenerationParams`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct CompletionFields {
    /// A string, a list of strings, a list of token ids or a list of such lists; parsed by
    /// validation so each shape gets a precise error message.
    #[schema(value_type = super::field_schemas::Prompt, required = true)]
    pub prompt: Option<Value>,
    /// Return the prompt before the completion (and, with `logprobs`, the prompt's logprobs).
    pub echo: Option<bool>,
    /// Report each token's logprob with this many alternatives, 0..=5.
    pub logprobs: Option<i64>,
    /// Generate this many choices (>= `n`) and return the `n` with the highest cumulative
    /// logprob.
    pub best_of: Option<u32>,
    /// Not supported: a non-empty one is refused by `crate::openai::fields`; kept so a wrong
    /// type is named.
    pub suffix: Option<String>,
}

pub const OBJECT: &str = "text_completion";
pub const ID_PREFIX: &str = "cmpl-";

/// A whole response, or one streamed chunk (then `usage` is absent except on the last).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionResponse {
    #[serde(flatten)]
    pub header: ObjectHeader,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// With `logprobs`: on a streamed chunk, the entries of that chunk's tokens.
    #[schema(required = true)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Null on streamed chunks before the choice's last one.
    #[schema(required = true)]
    pub finish_reason: Option<FinishReason>,
    /// With `return_token_ids` (vLLM's extension; per choice because each prompt differs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// With `prompt_logprobs` (vLLM's extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}
