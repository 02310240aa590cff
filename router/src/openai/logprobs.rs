//! The logprob shapes of responses: chat's `logprobs.content`, completions' legacy
//! `logprobs` object, and vLLM's `prompt_logprobs` extension (both endpoints).

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::ToSchema;

/// Chat: `choices[].logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always null: refusals are never generated.
    #[schema(required = true)]
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

/// One generated token: its text decoded alone, raw logprob, UTF-8 bytes, alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// Completions: `choices[].logprobs`, four parallel lists. With `echo`, the first prompt
/// token has no logprob and no alternatives (`null`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    pub fn extend(&mut self, more: CompletionLogprobs) {
        self.tokens.extend(more.tokens);
        self.token_logprobs.extend(more.token_logprobs);
        self.top_logprobs.extend(more.top_logprobs);
        self.text_offset.extend(more.text_offset);
    }
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then per prompt token a map
/// from token id (as a string) to its entry: the prompt token itself and the alternatives.
pub type PromptLogprobs = Vec<Option<BTreeMap<String, PromptLogprobEntry>>>;

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct PromptLogprobEntry {
    pub logprob: f32,
    /// 1-based rank under the distribution.
    pub rank: u32,
    pub decoded_token: String,
}
