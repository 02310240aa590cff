//! `POST /v1/completions`: one object shape (`"text_completion"`) for the whole response and
//! for its streamed chunks. The request path is `endpoint::generate`.

use super::endpoint::{Endpoint, FinishedChoice};
use super::sse::{ChoiceStep, ChunkFormat};
use crate::openai::common::{ObjectHeader, Usage};
use crate::openai::completions::{
    CompletionChoice, CompletionFields, CompletionResponse, ID_PREFIX, OBJECT,
};

/// One completions request's chunks and response.
pub struct Completions {
    header: ObjectHeader,
    /// Per choice, until sent with its first chunk (empty without `return_token_ids`): each
    /// prompt of a batched `prompt` has ids of its own.
    prompt_token_ids: Vec<Option<Vec<u32>>>,
}

impl Endpoint for Completions {
    type Fields = CompletionFields;
    type Response = CompletionResponse;

    fn new(model: String, prompt_token_ids: Option<Vec<Vec<u32>>>) -> Self {
        let per_choice = prompt_token_ids.unwrap_or_default();
        Self {
            header: ObjectHeader::new(ID_PREFIX, OBJECT, model),
            prompt_token_ids: per_choice.into_iter().map(Some).collect(),
        }
    }

    fn response(mut self, choices: Vec<FinishedChoice>, usage: Usage) -> CompletionResponse {
        let choices = choices
            .into_iter()
            .map(|choice| CompletionChoice {
                prompt_token_ids: self.take_prompt_ids(choice.index),
                index: choice.index,
                text: choice.text,
                logprobs: None,
                finish_reason: Some(choice.finish_reason),
                token_ids: choice.token_ids,
            })
            .collect();
        self.object(choices, Some(usage))
    }
}

impl Completions {
    fn take_prompt_ids(&mut self, index: u32) -> Option<Vec<u32>> {
        self.prompt_token_ids
            .get_mut(index as usize)
            .and_then(Option::take)
    }

    fn object(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            header: self.header.clone(),
            choices,
            usage,
        }
    }
}

impl ChunkFormat for Completions {
    type Chunk = CompletionResponse;

    fn choice(&mut self, index: u32, step: ChoiceStep) -> Option<CompletionResponse> {
        let (text, finish_reason, token_ids) = match step {
            // No role to announce: a choice starts with its first text.
            ChoiceStep::Opening => return None,
            ChoiceStep::Text { text, token_ids } => (text, None, token_ids),
            ChoiceStep::Finish { reason, token_ids } => (String::new(), Some(reason), token_ids),
        };
        let choice = CompletionChoice {
            prompt_token_ids: self.take_prompt_ids(index),
            index,
            text,
            logprobs: None,
            finish_reason,
            token_ids,
        };
        Some(self.object(vec![choice], None))
    }

    fn usage(&mut self, usage: Usage) -> CompletionResponse {
        self.object(Vec::new(), Some(usage))
    }
}
