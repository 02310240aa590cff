//! `POST /v1/chat/completions`: text in `message` / `delta.content`, the role announced on
//! each choice's opening chunk. The request path is `endpoint::generate`.

use super::endpoint::{Endpoint, FinishedChoice};
use super::sse::{ChoiceStep, ChunkFormat};
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatFields, CHUNK_OBJECT, ID_PREFIX, OBJECT,
};
use crate::openai::common::{ObjectHeader, Usage};

/// One chat request's chunks and response.
pub struct Chat {
    header: ObjectHeader,
    /// The prompt's ids (`return_token_ids`): on choice 0's opening chunk, or at the top of
    /// the response. Every choice shares the one rendered prompt.
    prompt_token_ids: Option<Vec<u32>>,
}

impl Endpoint for Chat {
    type Fields = ChatFields;
    type Response = ChatCompletionResponse;

    fn new(model: String, prompt_token_ids: Option<Vec<Vec<u32>>>) -> Self {
        Self {
            header: ObjectHeader::new(ID_PREFIX, OBJECT, model),
            prompt_token_ids: prompt_token_ids
                .map(|per_choice| per_choice.into_iter().next().unwrap_or_default()),
        }
    }

    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> ChatCompletionResponse {
        ChatCompletionResponse {
            header: self.header,
            choices: choices
                .into_iter()
                .map(|choice| ChatChoice {
                    index: choice.index,
                    message: AssistantMessage::new(choice.text),
                    logprobs: None,
                    finish_reason: choice.finish_reason,
                    token_ids: choice.token_ids,
                })
                .collect(),
            usage,
            prompt_token_ids: self.prompt_token_ids,
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
        let (delta, finish_reason, token_ids) = match step {
            ChoiceStep::Opening => {
                if index == 0 {
                    prompt_token_ids = self.prompt_token_ids.clone();
                }
                let role = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                };
                (role, None, None)
            }
            ChoiceStep::Text { text, token_ids } => {
                let content = ChatDelta {
                    role: None,
                    content: Some(text),
                };
                (content, None, token_ids)
            }
            // The finish chunk's delta is `{}`.
            ChoiceStep::Finish { reason, token_ids } => {
                (ChatDelta::default(), Some(reason), token_ids)
            }
        };
        let choice = ChatChunkChoice {
            index,
            delta,
            logprobs: None,
            finish_reason,
            token_ids,
        };
        Some(self.chunk(vec![choice], None, prompt_token_ids))
    }

    fn usage(&mut self, usage: Usage) -> ChatCompletionChunk {
        self.chunk(Vec::new(), Some(usage), None)
    }
}
