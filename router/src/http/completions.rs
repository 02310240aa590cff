//! `POST /v1/completions`: one object shape (`"text_completion"`) for the whole response and
//! for its streamed chunks. The request path is `endpoint::generate`.
//!
//! With `echo`, a choice's text starts with its prompt's text and, with `logprobs`, its
//! logprobs with the prompt's entries; streamed, the prompt comes on the choice's first chunk.

use super::endpoint::{Endpoint, FinishedChoice, ResponseSetup};
use super::logprobs::CompletionOffsets;
use super::sse::{ChoiceStep, ChunkFormat};
use crate::core::GeneratedToken;
use crate::openai::common::{ObjectHeader, Usage};
use crate::openai::completions::{
    CompletionChoice, CompletionFields, CompletionResponse, ID_PREFIX, OBJECT,
};
use crate::openai::logprobs::CompletionLogprobs;
use crate::scheduler::PromptPosition;

/// One completions request's chunks and response.
pub struct Completions {
    header: ObjectHeader,
    setup: ResponseSetup,
    /// Per streamed choice: whether its first chunk (the one with the prompt's ids and the
    /// echoed prompt) was sent, and where its `text_offset` stands.
    started: Vec<bool>,
    offsets: Vec<CompletionOffsets>,
}

impl Endpoint for Completions {
    type Context = ();
    type Fields = CompletionFields;
    type Response = CompletionResponse;

    fn new(setup: ResponseSetup, (): ()) -> Self {
        let choices = setup.prompts.len() * setup.options.n as usize;
        Self {
            header: ObjectHeader::new(ID_PREFIX, OBJECT, setup.model.clone()),
            setup,
            started: vec![false; choices],
            offsets: vec![CompletionOffsets::default(); choices],
        }
    }

    fn response(mut self, choices: Vec<FinishedChoice>, usage: Usage) -> CompletionResponse {
        let choices = choices
            .into_iter()
            .map(|FinishedChoice { index, output }| {
                let positions = output.prompt.as_deref();
                let (mut text, mut logprobs) = self.opening(index, positions);
                text.push_str(&output.text);
                let generated = self.generated(index, &output.tokens);
                logprobs = merge(logprobs, generated);
                CompletionChoice {
                    prompt_token_ids: self.prompt_ids(index),
                    index,
                    text,
                    logprobs,
                    finish_reason: Some(output.finish_reason),
                    token_ids: self.ids(&output.tokens),
                    prompt_logprobs: self.setup.prompt_logprobs(index, positions),
                }
            })
            .collect();
        self.object(choices, Some(usage))
    }
}

fn merge(
    first: Option<CompletionLogprobs>,
    then: Option<CompletionLogprobs>,
) -> Option<CompletionLogprobs> {
    match (first, then) {
        (Some(mut first), Some(then)) => {
            first.extend(then);
            Some(first)
        }
        (first, then) => first.or(then),
    }
}

impl Completions {
    fn prompt_ids(&self, index: u32) -> Option<Vec<u32>> {
        let prompt = self.setup.prompt(index)?;
        self.setup.token_ids(|| prompt.ids.clone())
    }

    fn ids(&self, tokens: &[GeneratedToken]) -> Option<Vec<u32>> {
        self.setup
            .token_ids(|| tokens.iter().map(|token| token.id).collect())
    }

    fn offsets(&mut self, index: u32) -> &mut CompletionOffsets {
        let at = index as usize;
        if at >= self.offsets.len() {
            self.offsets.resize(at + 1, CompletionOffsets::default());
        }
        &mut self.offsets[at]
    }

    /// What comes before the generated text: with `echo` the prompt's text and, with
    /// `logprobs`, the prompt's entries (from `positions`).
    fn opening(
        &mut self,
        index: u32,
        positions: Option<&[PromptPosition]>,
    ) -> (String, Option<CompletionLogprobs>) {
        let options = self.setup.options.logprobs;
        let Some(prompt) = self.setup.prompt(index).filter(|_| options.echo) else {
            return (String::new(), None);
        };
        let text = prompt.echo.clone().unwrap_or_default();
        let Some(k) = options.tokens else {
            return (text, None);
        };
        let ids = prompt.ids.clone();
        let tokenizer = self.setup.tokenizer.clone();
        let entries =
            self.offsets(index)
                .prompt(&tokenizer, &ids, positions.unwrap_or_default(), k);
        (text, Some(entries))
    }

    /// With `logprobs`, the entries of generated `tokens`.
    fn generated(&mut self, index: u32, tokens: &[GeneratedToken]) -> Option<CompletionLogprobs> {
        let k = self.setup.options.logprobs.tokens?;
        let tokenizer = self.setup.tokenizer.clone();
        Some(self.offsets(index).generated(&tokenizer, tokens, k))
    }

    fn object(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            header: self.header.clone(),
            choices,
            usage,
        }
    }

    /// A chunk of choice `index`; its first one carries the prompt's ids.
    fn chunk(&mut self, mut choice: CompletionChoice) -> CompletionResponse {
        let at = choice.index as usize;
        if self.started.get(at) == Some(&false) {
            self.started[at] = true;
            choice.prompt_token_ids = self.prompt_ids(choice.index);
        }
        self.object(vec![choice], None)
    }
}

impl ChunkFormat for Completions {
    type Chunk = CompletionResponse;

    fn choice(&mut self, index: u32, step: ChoiceStep) -> Vec<CompletionResponse> {
        self.step_chunk(index, step).into_iter().collect()
    }

    fn usage(&mut self, usage: Usage) -> Vec<CompletionResponse> {
        vec![{ self.object(Vec::new(), Some(usage)) }]
    }
}

impl Completions {
    /// The one chunk (if any) of a step.
    fn step_chunk(&mut self, index: u32, step: ChoiceStep) -> Option<CompletionResponse> {
        let mut choice = CompletionChoice {
            prompt_token_ids: None,
            index,
            text: String::new(),
            logprobs: None,
            finish_reason: None,
            token_ids: None,
            prompt_logprobs: None,
        };
        let options = self.setup.options.logprobs;
        match step {
            // The echoed prompt opens the choice, unless its logprobs are still to come.
            ChoiceStep::Opening => {
                if !options.echo || options.shard_prompt_logprobs().is_some() {
                    return None;
                }
                (choice.text, choice.logprobs) = self.opening(index, None);
            }
            ChoiceStep::Prompt { positions } => {
                (choice.text, choice.logprobs) = self.opening(index, Some(&positions));
                choice.prompt_logprobs = self.setup.prompt_logprobs(index, Some(&positions));
            }
            ChoiceStep::Text { text, tokens } => {
                choice.text = text;
                choice.logprobs = self.generated(index, &tokens);
                choice.token_ids = self.ids(&tokens);
            }
            ChoiceStep::Finish { reason, tokens } => {
                choice.finish_reason = Some(reason);
                if !tokens.is_empty() {
                    choice.logprobs = self.generated(index, &tokens);
                }
                choice.token_ids = self.ids(&tokens);
            }
        }
        Some(self.chunk(choice))
    }
}
