//! The streaming state machine shared by chat, completions and responses: per choice an optional
//! opening chunk (chat's `role`), its text deltas, exactly one finish chunk; then the usage
//! chunk if asked for, then `data: [DONE]` (where the endpoint ends that way). An error after
//! the stream started becomes a final error event. Dropping the stream (client gone) drops
//! every choice's receiver, which cancels the requests in the scheduler. An endpoint whose
//! events are typed (the Responses API's) names each in the SSE `event:` field.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{self, BoxStream, Stream, StreamExt};
use serde::Serialize;

use crate::core::Cutoff;
use crate::core::{prompt_cached_tokens, ChoiceEvent, GeneratedToken};
use crate::error::ApiError;
use crate::openai::common::{FinishReason, Usage};
use crate::scheduler::PromptPosition;

/// How one endpoint spells its chunks.
pub trait ChunkFormat: Send + 'static {
    type Chunk: Serialize + Send;
    /// The chunks for one step of choice `index`, in order (none when the endpoint sends
    /// nothing for it; several when chat splits tool-call deltas).
    fn choice(&mut self, index: u32, step: ChoiceStep) -> Vec<Self::Chunk>;
    /// The last chunks before `[DONE]` with `stream_options.include_usage`.
    fn usage(&mut self, usage: Usage) -> Vec<Self::Chunk>;
    /// The event that reports an error once the stream has started.
    fn error(&mut self, error: &ApiError) -> serde_json::Value {
        serde_json::to_value(error.to_body()).unwrap_or_default()
    }
    /// The SSE `event:` name of a chunk (none: a plain `data:` event).
    fn event_name(_chunk: &Self::Chunk) -> Option<String> {
        None
    }
    /// The SSE `event:` name of `error`'s event.
    const ERROR_EVENT: Option<&'static str> = None;
    /// Whether the stream ends with `data: [DONE]` (chat and completions; OpenAI's Responses
    /// streams end with their last typed event).
    const ENDS_WITH_DONE: bool = true;
}

/// What one chunk of a choice reports; `tokens` are those whose text the chunk carries.
pub enum ChoiceStep {
    /// Once per choice, before any text (chat announces the role here).
    Opening,
    /// The prompt's logprobs, when the request asked for them, before any text.
    Prompt { positions: Vec<PromptPosition> },
    Text {
        text: String,
        tokens: Vec<GeneratedToken>,
    },
    /// The choice's last chunk.
    Finish {
        reason: FinishReason,
        tokens: Vec<GeneratedToken>,
    },
}

pub struct StreamPlan {
    pub choices: Vec<BoxStream<'static, ChoiceEvent>>,
    pub prompt_tokens: u32,
    /// Choices of one prompt (they come in groups): `usage` counts each prompt's cache hits once.
    pub choices_per_prompt: usize,
    pub include_usage: bool,
    /// A reasoning split counts thinking tokens: usage reports them.
    pub counts_reasoning: bool,
    /// Ends the stream with an error event when the grace period runs out.
    pub cutoff: Cutoff,
}

pub fn sse_response<F: ChunkFormat>(
    format: F,
    plan: StreamPlan,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    Sse::new(chunk_events(format, plan).map(Ok)).keep_alive(KeepAlive::default())
}

fn chunk_events<F: ChunkFormat>(mut format: F, plan: StreamPlan) -> impl Stream<Item = Event> {
    let StreamPlan {
        choices,
        prompt_tokens,
        choices_per_prompt,
        include_usage,
        counts_reasoning,
        cutoff,
    } = plan;
    async_stream::stream! {
        for index in 0..choices.len() as u32 {
            for chunk in format.choice(index, ChoiceStep::Opening) {
                yield chunk_event::<F>(&chunk);
            }
        }
        let mut cached_per_choice = vec![0u32; choices.len()];
        let mut events = stream::select_all(choices);
        let mut completion_tokens = 0u32;
        let mut reasoning_tokens = 0u32;
        loop {
            let next = tokio::select! {
                event = events.next() => Next::Event(event),
                () = cutoff.fired() => Next::Cut,
            };
            let event = match next {
                Next::Event(Some(event)) => event,
                Next::Event(None) => break,
                Next::Cut => {
                    // Cancel the choices, then end the stream so that the client can tell.
                    drop(events);
                    cutoff.record_cut();
                    yield error_event::<F>(format.error(&ApiError::GracePeriodOver));
                    if F::ENDS_WITH_DONE {
                        yield done_event();
                    }
                    return;
                }
            };
            let (index, step) = match event {
                ChoiceEvent::Prompt { index, positions } => {
                    (index, ChoiceStep::Prompt { positions })
                }
                ChoiceEvent::Text { index, text, tokens } => {
                    (index, ChoiceStep::Text { text, tokens })
                }
                ChoiceEvent::Finish {
                    index, reason, tokens, completion_tokens: generated, reasoning_tokens: thought,
                    cached_tokens,
                } => {
                    completion_tokens += generated;
                    reasoning_tokens += thought;
                    if let Some(slot) = cached_per_choice.get_mut(index as usize) {
                        *slot = cached_tokens;
                    }
                    (index, ChoiceStep::Finish { reason, tokens })
                }
                ChoiceEvent::Failed(error) => {
                    // Cancel the other choices before telling the client.
                    drop(events);
                    tracing::error!(%error, "stream failed after it started");
                    yield error_event::<F>(format.error(&error));
                    if F::ENDS_WITH_DONE {
                        yield done_event();
                    }
                    return;
                }
            };
            for chunk in format.choice(index, step) {
                yield chunk_event::<F>(&chunk);
            }
        }
        if include_usage {
            let cached = prompt_cached_tokens(&cached_per_choice, choices_per_prompt);
            let usage = Usage::new(prompt_tokens, completion_tokens)
                .with_cached(cached)
                .with_reasoning(counts_reasoning.then_some(reasoning_tokens));
            for chunk in format.usage(usage) {
                yield chunk_event::<F>(&chunk);
            }
        }
        if F::ENDS_WITH_DONE {
            yield done_event();
        }
    }
}

enum Next {
    Event(Option<ChoiceEvent>),
    Cut,
}

fn error_event<F: ChunkFormat>(body: serde_json::Value) -> Event {
    named_event(F::ERROR_EVENT.map(str::to_owned), &body)
}

/// A chunk's event, named where the endpoint names its events.
fn chunk_event<F: ChunkFormat>(chunk: &F::Chunk) -> Event {
    named_event(F::event_name(chunk), chunk)
}

/// An event whose `data` is `chunk` as JSON, `event: name` before it when named.
fn named_event<T: Serialize>(name: Option<String>, chunk: &T) -> Event {
    let json = serde_json::to_string(chunk).unwrap_or_else(|error| {
        // Our chunk types always serialize; keep the stream well-formed if one ever does not.
        let error = ApiError::Internal(format!("cannot serialize a chunk: {error}"));
        serde_json::to_value(error.to_body())
            .unwrap_or_default()
            .to_string()
    });
    match name {
        Some(name) => Event::default().event(name).data(json),
        None => Event::default().data(json),
    }
}

fn done_event() -> Event {
    Event::default().data("[DONE]")
}
