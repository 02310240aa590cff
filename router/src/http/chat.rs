//! `POST /v1/chat/completions`: text in `message` / `delta.content`, the role announced on
//! each choice's opening chunk; a thinking model's reasoning in `message.reasoning_content` /
//! `delta.reasoning_content`; with `tools`, calls in `message.tool_calls` / `delta.tool_calls`
//! (legacy `functions`: `function_call`), read from the content alone. The request path is
//! `endpoint::generate`.

use std::collections::HashMap;

use super::chat_reader::{ChoiceReader, ReplyDelta};
use super::endpoint::{Endpoint, FinishedChoice, ResponseSetup};
use super::logprobs::chat_logprobs;
use super::sse::{ChoiceStep, ChunkFormat};
use crate::core::GeneratedToken;
use crate::openai::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatFields, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta, CHUNK_OBJECT,
    ID_PREFIX, OBJECT,
};
use crate::openai::common::{FinishReason, ObjectHeader, Usage};
use crate::openai::logprobs::ChatLogprobs;
use crate::tool_calls::{call_id, ParsedOutput, ToolDelta, ToolPlan};

/// One chat request's chunks and response.
pub struct Chat {
    header: ObjectHeader,
    setup: ResponseSetup,
    /// With tools or a reasoning split, per streamed choice: its reader.
    readers: HashMap<u32, ChoiceReader>,
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

    /// The plan, when replies are read for calls.
    fn tools(&self) -> Option<&ToolPlan> {
        self.setup.tools.as_ref().filter(|plan| plan.reads_calls())
    }

    /// Whether calls are answered in the legacy `function_call` shape.
    fn legacy(&self) -> bool {
        self.setup
            .tools
            .as_ref()
            .is_some_and(|plan| plan.request.legacy)
    }

    /// The finish reason of a reply that holds calls (OpenAI's), unless it was cut short.
    fn calls_finish(&self, reason: FinishReason) -> FinishReason {
        match (reason, self.legacy()) {
            (FinishReason::Stop, true) => FinishReason::FunctionCall,
            (FinishReason::Stop, false) => FinishReason::ToolCalls,
            (reason, _) => reason,
        }
    }

    /// A finished reply's message, its content read for calls.
    fn tool_message(&self, parsed: ParsedOutput) -> AssistantMessage {
        let mut message = AssistantMessage::new(parsed.content);
        if parsed.tool_calls.is_empty() {
            return message;
        }
        let mut calls = parsed.tool_calls.into_iter().map(|call| FunctionCall {
            name: call.name,
            arguments: call.arguments,
        });
        if self.legacy() {
            message.function_call = calls.next();
        } else {
            message.tool_calls = Some(
                calls
                    .map(|function| ToolCall {
                        id: call_id(),
                        kind: "function",
                        function,
                    })
                    .collect(),
            );
        }
        message
    }

    /// A finished reply's message: its reasoning split off first (a thinking model), then the
    /// content read for calls (with tools).
    fn message(&self, text: String, reason: FinishReason) -> (AssistantMessage, FinishReason) {
        let (reasoning, content) = match &self.setup.reasoning {
            Some(plan) => {
                let split = plan.split(&text);
                (Some(split.reasoning), split.content)
            }
            None => (None, Some(text)),
        };
        let (mut message, reason) = match self.tools() {
            None => (AssistantMessage::new(content), reason),
            Some(plan) => {
                let parsed = plan.parse(
                    content.as_deref().unwrap_or_default(),
                    reason == FinishReason::Length,
                );
                let reason = match parsed.tool_calls.is_empty() {
                    true => reason,
                    false => self.calls_finish(reason),
                };
                (self.tool_message(parsed), reason)
            }
        };
        message.reasoning_content = reasoning;
        (message, reason)
    }
}

impl Endpoint for Chat {
    type Context = ();
    type Fields = ChatFields;
    type Response = ChatCompletionResponse;

    fn new(setup: ResponseSetup, (): ()) -> Self {
        Self {
            header: ObjectHeader::new(ID_PREFIX, OBJECT, setup.model.clone()),
            setup,
            readers: HashMap::new(),
        }
    }

    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> ChatCompletionResponse {
        let choices = choices
            .into_iter()
            .map(|FinishedChoice { index, output }| {
                let (message, finish_reason) = self.message(output.text, output.finish_reason);
                ChatChoice {
                    index,
                    logprobs: self.logprobs(&output.tokens),
                    token_ids: self.ids(&output.tokens),
                    prompt_logprobs: self.setup.prompt_logprobs(index, output.prompt.as_deref()),
                    message,
                    finish_reason,
                }
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

    fn choice_chunk(&self, choice: ChatChunkChoice) -> ChatCompletionChunk {
        self.chunk(vec![choice], None, None)
    }

    /// Whether streamed text goes through a reader (tools read for calls, a reasoning split).
    fn reads_text(&self) -> bool {
        self.tools().is_some() || self.setup.reasoning.is_some()
    }

    /// The reader of choice `index`, made on its first text.
    fn reader(&mut self, index: u32) -> &mut ChoiceReader {
        let setup = &self.setup;
        self.readers.entry(index).or_insert_with(|| {
            let calls = setup.tools.as_ref().filter(|plan| plan.reads_calls());
            ChoiceReader::new(
                setup.reasoning.as_ref().map(|plan| plan.splitter()),
                calls.map(ToolPlan::stream),
            )
        })
    }

    /// A text step of a choice with a reader: one chunk per delta; tokens whose text is held
    /// back are reported with the next chunk that goes out.
    fn reader_text(
        &mut self,
        index: u32,
        text: &str,
        tokens: Vec<GeneratedToken>,
    ) -> Vec<ChatCompletionChunk> {
        let reader = self.reader(index);
        reader.held.extend(tokens);
        let deltas = reader.push(text);
        self.delta_chunks(index, deltas)
    }

    /// Chunks of `deltas`; the held tokens go with the first.
    fn delta_chunks(&mut self, index: u32, deltas: Vec<ReplyDelta>) -> Vec<ChatCompletionChunk> {
        let legacy = self.legacy();
        let mut chunks = Vec::new();
        for delta in deltas {
            let Some(delta) = chat_delta(delta, legacy) else {
                continue;
            };
            let mut choice = empty_choice(index);
            if chunks.is_empty() {
                let held = std::mem::take(&mut self.reader(index).held);
                choice.logprobs = self.logprobs(&held);
                choice.token_ids = self.ids(&held);
            }
            choice.delta = delta;
            chunks.push(self.choice_chunk(choice));
        }
        chunks
    }

    /// The last chunks of a choice with a reader: what the finished reply adds, then the finish
    /// chunk with the tokens still held.
    fn reader_finish(
        &mut self,
        index: u32,
        reason: FinishReason,
        tokens: Vec<GeneratedToken>,
    ) -> Vec<ChatCompletionChunk> {
        let (deltas, has_calls) = self.reader(index).finish(reason == FinishReason::Length);
        let mut chunks = self.delta_chunks(index, deltas);
        let mut held = self
            .readers
            .remove(&index)
            .map(|reader| reader.held)
            .unwrap_or_default();
        held.extend(tokens);
        let mut choice = empty_choice(index);
        choice.finish_reason = Some(match has_calls {
            true => self.calls_finish(reason),
            false => reason,
        });
        if !held.is_empty() {
            choice.logprobs = self.logprobs(&held);
        }
        choice.token_ids = self.ids(&held);
        chunks.push(self.choice_chunk(choice));
        chunks
    }
}

/// The delta of one reader delta; `None` for a call the legacy shape has no room for.
fn chat_delta(delta: ReplyDelta, legacy: bool) -> Option<ChatDelta> {
    let (index, id, name, arguments) = match delta {
        ReplyDelta::Reasoning(text) => {
            return Some(ChatDelta {
                reasoning_content: Some(text),
                ..ChatDelta::default()
            })
        }
        ReplyDelta::Content(ToolDelta::Content(text)) => {
            return Some(ChatDelta {
                content: Some(text),
                ..ChatDelta::default()
            })
        }
        ReplyDelta::Content(ToolDelta::CallStart { index, id, name }) => {
            (index, Some(id), Some(name), String::new())
        }
        ReplyDelta::Content(ToolDelta::Arguments { index, text }) => (index, None, None, text),
    };
    let function = FunctionCallDelta { name, arguments };
    if legacy {
        // The legacy shape has one call.
        return (index == 0).then(|| ChatDelta {
            function_call: Some(function),
            ..ChatDelta::default()
        });
    }
    Some(ChatDelta {
        tool_calls: Some(vec![ToolCallDelta {
            index: index as u32,
            kind: id.as_ref().map(|_| "function"),
            id,
            function,
        }]),
        ..ChatDelta::default()
    })
}

fn empty_choice(index: u32) -> ChatChunkChoice {
    ChatChunkChoice {
        index,
        delta: ChatDelta::default(),
        logprobs: None,
        finish_reason: None,
        token_ids: None,
        prompt_logprobs: None,
    }
}

impl ChunkFormat for Chat {
    type Chunk = ChatCompletionChunk;

    fn choice(&mut self, index: u32, step: ChoiceStep) -> Vec<ChatCompletionChunk> {
        let mut prompt_token_ids = None;
        let mut choice = empty_choice(index);
        let reads_text = self.reads_text();
        match step {
            ChoiceStep::Opening => {
                if index == 0 {
                    prompt_token_ids = self.prompt_token_ids();
                }
                choice.delta = ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..ChatDelta::default()
                };
            }
            ChoiceStep::Prompt { positions } => {
                choice.prompt_logprobs = self.setup.prompt_logprobs(index, Some(&positions));
                if choice.prompt_logprobs.is_none() {
                    return Vec::new();
                }
                choice.delta.content = Some(String::new());
            }
            ChoiceStep::Text { text, tokens } => {
                if reads_text {
                    return self.reader_text(index, &text, tokens);
                }
                choice.delta.content = Some(text);
                choice.logprobs = self.logprobs(&tokens);
                choice.token_ids = self.ids(&tokens);
            }
            // The finish chunk's delta is `{}`; it reports the tokens that made no text.
            ChoiceStep::Finish { reason, tokens } => {
                if reads_text {
                    return self.reader_finish(index, reason, tokens);
                }
                choice.finish_reason = Some(reason);
                if !tokens.is_empty() {
                    choice.logprobs = self.logprobs(&tokens);
                }
                choice.token_ids = self.ids(&tokens);
            }
        }
        vec![self.chunk(vec![choice], None, prompt_token_ids)]
    }

    fn usage(&mut self, usage: Usage) -> Vec<ChatCompletionChunk> {
        vec![{ self.chunk(Vec::new(), Some(usage), None) }]
    }
}

#[cfg(test)]
#[path = "chat_tool_tests.rs"]
mod tool_tests;

#[cfg(test)]
#[path = "chat_reasoning_tests.rs"]
mod reasoning_tests;
