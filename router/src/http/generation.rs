//! From scheduler token events to text: each choice's events go through the incremental
//! detokenizer, then the stop-string matcher, and come out as `ChoiceEvent`s that the JSON and
//! SSE responders both consume.

use std::sync::Arc;

use futures::stream::{BoxStream, StreamExt};

use crate::detokenizer::IncrementalDetokenizer;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::common::FinishReason;
use crate::scheduler::{self, EventReceiver, GenerationError, GenerationRequest, Scheduler};
use crate::shard::ShardBackend;
use crate::stop::StopMatcher;
use crate::tokenizer::TextTokenizer;

#[derive(Debug)]
pub enum ChoiceEvent {
    /// New text of choice `index`, with the ids of the tokens generated since the last event
    /// (some tokens produce no text yet: half a UTF-8 character, a possible stop string).
    Text {
        index: u32,
        text: String,
        token_ids: Vec<u32>,
    },
    /// The choice's last event: `token_ids` are those not reported yet; `completion_tokens`
    /// counts every token generated for it.
    Finish {
        index: u32,
        reason: FinishReason,
        token_ids: Vec<u32>,
        completion_tokens: u32,
    },
    /// The choice failed; the whole response fails with it.
    Failed(ApiError),
}

/// Submits every choice, as one request for admission, and returns their event streams, in
/// choice order.
pub fn start_choices(
    scheduler: &Scheduler,
    shard: &Arc<dyn ShardBackend>,
    metrics: &Arc<Metrics>,
    tokenizer: &TextTokenizer,
    choices: Vec<GenerationRequest>,
    stop: &[String],
) -> Result<Vec<BoxStream<'static, ChoiceEvent>>, ApiError> {
    let prompt_tokens: usize = choices.iter().map(|choice| choice.input_ids.len()).sum();
    let receivers = scheduler.submit_all(choices)?;
    Metrics::add(&metrics.prompt_tokens_total, prompt_tokens as u64);
    Ok(receivers
        .into_iter()
        .zip(0..)
        .map(|(receiver, index)| {
            let outcome = Outcome {
                metrics: metrics.clone(),
                shard: shard.clone(),
            };
            choice_events(index, receiver, tokenizer.clone(), stop.to_vec(), outcome)
        })
        .collect())
}

/// Where a choice reports how it ended: the metrics, and the shard whose state says what a
/// failure was.
pub struct Outcome {
    pub metrics: Arc<Metrics>,
    pub shard: Arc<dyn ShardBackend>,
}

impl Outcome {
    /// A failed choice. While the shard is known gone, its failure is the shard being
    /// unavailable (503), not an error of this request (500).
    fn failed(&self, error: ApiError) -> ChoiceEvent {
        Metrics::add(&self.metrics.requests_failed_total, 1);
        let error = match error {
            ApiError::Generation(GenerationError::Shard(_)) | ApiError::Internal(_)
                if self.shard.is_unavailable() =>
            {
                ApiError::shard_gone()
            }
            error => error,
        };
        ChoiceEvent::Failed(error)
    }
}

/// The events of one choice. The receiver is dropped as soon as the choice ends (stop string,
/// EOS, length) or the stream itself is dropped (client gone), which frees the request.
pub fn choice_events(
    index: u32,
    mut receiver: EventReceiver,
    tokenizer: TextTokenizer,
    stop: Vec<String>,
    outcome: Outcome,
) -> BoxStream<'static, ChoiceEvent> {
    let metrics = outcome.metrics.clone();
    // The EOS token's text is never shown (skip_special_tokens), even for tokenizers that do
    // not mark it special: an EOS event is not fed to the detokenizer at all.
    let mut detokenizer = IncrementalDetokenizer::new(tokenizer, true);
    let mut stop = StopMatcher::new(stop);
    async_stream::stream! {
        let mut pending_ids = Vec::new();
        let mut generated = 0u32;
        loop {
            let event = match receiver.recv().await {
                Some(Ok(event)) => event,
                Some(Err(error)) => {
                    yield outcome.failed(error.into());
                    return;
                }
                None => {
                    yield outcome.failed(ApiError::Internal(
                        "the scheduler ended the request without a finish event".to_owned(),
                    ));
                    return;
                }
            };
            generated += 1;
            Metrics::add(&metrics.generated_tokens_total, 1);
            pending_ids.push(event.token_id);
            let mut text = String::new();
            if event.finish != Some(scheduler::FinishReason::Eos) {
                match detokenizer.push(event.token_id) {
                    Ok(new_text) => text = new_text,
                    Err(error) => {
                        yield outcome.failed(error.into());
                        return;
                    }
                }
            }
            if event.finish.is_some() {
                text.push_str(&detokenizer.finish());
            }
            let step = stop.push(&text);
            let mut text = step.text;
            let reason = if step.stopped {
                Some(FinishReason::Stop)
            } else {
                event.finish.map(|finish| match finish {
                    scheduler::FinishReason::Eos => FinishReason::Stop,
                    scheduler::FinishReason::Length => FinishReason::Length,
                })
            };
            let Some(reason) = reason else {
                if !text.is_empty() {
                    yield ChoiceEvent::Text { index, text, token_ids: std::mem::take(&mut pending_ids) };
                }
                continue;
            };
            // Finished: let the scheduler free the request before anything else is sent.
            drop(receiver);
            Metrics::add(&metrics.requests_finished_total, 1);
            if !step.stopped {
                text.push_str(&stop.finish());
            }
            if !text.is_empty() {
                yield ChoiceEvent::Text { index, text, token_ids: std::mem::take(&mut pending_ids) };
            }
            yield ChoiceEvent::Finish { index, reason, token_ids: pending_ids, completion_tokens: generated };
            return;
        }
    }
    .boxed()
}

/// A finished choice, for non-streamed responses.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub completion_tokens: u32,
}

/// Runs every choice to its end, concurrently; the first failure cancels the rest.
pub async fn collect_choices(
    choices: Vec<BoxStream<'static, ChoiceEvent>>,
) -> Result<Vec<ChoiceOutput>, ApiError> {
    futures::future::try_join_all(choices.into_iter().map(collect_choice)).await
}

async fn collect_choice(
    mut events: BoxStream<'static, ChoiceEvent>,
) -> Result<ChoiceOutput, ApiError> {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    while let Some(event) = events.next().await {
        match event {
            ChoiceEvent::Text {
                text: new_text,
                token_ids: new_ids,
                ..
            } => {
                text.push_str(&new_text);
                token_ids.extend(new_ids);
            }
            ChoiceEvent::Finish {
                reason,
                token_ids: new_ids,
                completion_tokens,
                ..
            } => {
                token_ids.extend(new_ids);
                return Ok(ChoiceOutput {
                    text,
                    token_ids,
                    finish_reason: reason,
                    completion_tokens,
                });
            }
            ChoiceEvent::Failed(error) => return Err(error),
        }
    }
    Err(ApiError::Internal(
        "a choice ended without finishing".to_owned(),
    ))
}
