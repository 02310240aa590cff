//! `POST /v1/chat/completions`: text in `message` / `delta.content`, the role announced on
//! each choice's opening chunk. The request path is `endpoint::generate`.

use super::endpoint::{Endpoint, FinishedChoice, ResponseSetup};
use super::generation::GeneratedToken;
use super::logprobs::chat_logprobs;
use super::sse::{ChoiceStep, ChunkFormat};
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatFields, CHUNK_OBJECT, ID_PREFIX, OBJECT,
};
use crate::openai::common::{ObjectHeader, Usage};
use crate::openai::logprobs::ChatLogprobs;

/// One chat request's chunks and response.
pub struct Chat {
    header: ObjectHeader,
    setup: ResponseSetup,
}

impl Chat {
    /// The prompt's ids (`return_token_ids`): on choice 0's opening chunk, or at the top of
    /// the response. Every choice shares the one rendered prompt.
    fn prompt_token_ids(&self) -> Option<Vec<u32>> {
        let prompt = self.setup.prompts.first()?;
        self.setup.token_ids(|| prompt.ids.clone())
    }

    /// With `logprobs: true`, the entries of `tokens`.
    fn logprobs(&self, tokens: &[GeneratedToken]) -> Option<ChatLogprobs> {
        let top = self.setup.options.logprobs.tokens?;
        Some(chat_logprobs(&self.setup.tokenizer, tokens, top))
    }

    fn ids(&self, tokens: &[GeneratedToken]) -> Option<Vec<u32>> {
        self.setup
            .token_ids(|| tokens.iter().map(|token| token.id).collect())
    }
}

impl Endpoint for Chat {
    type Fields = ChatFields;
    type Response = ChatCompletionResponse;

    fn new(setup: ResponseSetup) -> Self {
        Self {
            header: ObjectHeader::new(ID_PREFIX, OBJECT, setup.model.clone()),
            setup,
        }
    }

    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> ChatCompletionResponse {
        let choices = choices
            .into_iter()
            .map(|FinishedChoice { index, output }| ChatChoice {
                index,
                logprobs: self.logprobs(&output.tokens),
                token_ids: self.ids(&output.tokens),
                prompt_logprobs: self.setup.prompt_logprobs(index, output.prompt.as_deref()),
                message: AssistantMessage::new(output.text),
                finish_reason: output.finish_reason,
            })
            .collect();
        ChatCompletionResponse {
            prompt_token_ids: self.prompt_token_ids(),
            header: self.header,
            choices,
            usage,
        }
    }
}

impl Chat {
    fn chunk(
        &self,
        choices: Vec<ChatChunkChoice>,
        usage: Option<Usage>,
        prompt_token_ids: Option<Vec<u32>>,
    ) -> ChatCompletionChunk {
        ChatCompletionChunk {
            header: self.header.with_object(CHUNK_OBJECT),
            choices,
            usage,
            prompt_token_ids,
        }
    }
}

impl ChunkFormat for Chat {
    type Chunk = ChatCompletionChunk;

    fn choice(&mut self, index: u32, step: ChoiceStep) -> Option<ChatCompletionChunk> {
        let mut prompt_token_ids = None;
        let mut choice = ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: None,
            token_ids: None,
            prompt_logprobs: None,
        };
        match step {
            ChoiceStep::Opening => {
                if index == 0 {
                    prompt_token_ids = self.prompt_token_ids();
                }
                choice.delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                };
            }
            ChoiceStep::Prompt { positions } => {
                choice.prompt_logprobs = self.setup.prompt_logprobs(index, Some(&positions));
                choice.prompt_logprobs.as_ref()?;
                choice.delta.content = Some(String::new());
            }
            ChoiceStep::Text { text, tokens } => {
                choice.delta.content = Some(text);
                choice.logprobs = self.logprobs(&tokens);
                choice.token_ids = self.ids(&tokens);
            }
            // The finish chunk's delta is `{}`; it reports the tokens that made no text.
            ChoiceStep::Finish { reason, tokens } => {
                choice.finish_reason = Some(reason);
                if !tokens.is_empty() {
                    choice.logprobs = self.logprobs(&tokens);
                }
                choice.token_ids = self.ids(&tokens);
            }
        }
        Some(self.chunk(vec![choice], None, prompt_token_ids))
    }

    fn usage(&mut self, usage: Usage) -> ChatCompletionChunk {
        self.chunk(Vec::new(), Some(usage), None)
    }
}
