//! From scheduler token events to text: each choice's events go through the incremental
//! detokenizer, then the stop-string matcher, and come out as `ChoiceEvent`s that the JSON and
//! SSE responders both consume.

use std::sync::Arc;

use futures::stream::{BoxStream, StreamExt};

use crate::detokenizer::IncrementalDetokenizer;
use crate::error::ApiError;
use crate::metrics::requests::RequestTimer;
use crate::metrics::Metrics;
use crate::openai::common::FinishReason;
use crate::reasoning::{ReasoningCounter, ReasoningSplitter};
use crate::scheduler::{
    self, EventReceiver, GenerationError, GenerationRequest, PromptPosition, Scheduler,
    TokenLogprob,
};
use crate::shard::ShardBackend;
use crate::stop::StopMatcher;
use crate::tokenizer::TextTokenizer;

/// A generated token as the responses report it: id, raw logprob, and the alternatives the
/// request asked for (none unless it asked).
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<TokenLogprob>,
}

/// How each choice's events are produced, the same for every choice of a request.
#[derive(Debug, Clone, Default)]
pub struct ChoiceSettings {
    /// Ends a choice when it appears in the text; never emitted.
    pub stop: Vec<String>,
    /// Report the prompt's logprobs (a `Prompt` event) before anything else.
    pub prompt_logprobs: bool,
    /// `max_tokens: 0` with `echo`: the one token generated (to get the prompt's logprobs) is
    /// dropped, and the choice ends with `length` and no completion tokens.
    pub drop_generation: bool,
    /// Keep special tokens in the text: a tool-call marker that is a special token
    /// (`[TOOL_CALLS]`) must reach the tool-call parser.
    pub keep_special_tokens: bool,
    /// A thinking model's split, to count each choice's thinking tokens (`reasoning_tokens`).
    pub reasoning: Option<ReasoningSplitter>,
}

#[derive(Debug)]
pub enum ChoiceEvent {
    /// The prompt's logprobs (one entry per prompt token after the first), first of all.
    Prompt {
        index: u32,
        positions: Vec<PromptPosition>,
    },
    /// New text of choice `index`, with the tokens generated since the last event (some
    /// tokens produce no text yet: half a UTF-8 character, a possible stop string), so that
    /// each token is reported with the text it produced.
    Text {
        index: u32,
        text: String,
        tokens: Vec<GeneratedToken>,
    },
    /// The choice's last event: `tokens` are those not reported yet; `completion_tokens`
    /// counts every token generated for it, `reasoning_tokens` those of them it spent thinking;
    /// `cached_tokens` its prompt tokens that the prefix cache supplied.
    Finish {
        index: u32,
        reason: FinishReason,
        tokens: Vec<GeneratedToken>,
        completion_tokens: u32,
        reasoning_tokens: u32,
        cached_tokens: u32,
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
    settings: &ChoiceSettings,
) -> Result<Vec<BoxStream<'static, ChoiceEvent>>, ApiError> {
    let prompt_tokens: usize = choices.iter().map(|choice| choice.input_ids.len()).sum();
    let timers: Vec<RequestTimer> = choices
        .iter()
        .map(|choice| {
            metrics
                .requests
                .start(&choice.adapter_id, choice.input_ids.len())
        })
        .collect();
    let receivers = scheduler.submit_all(choices)?;
    Metrics::add(&metrics.prompt_tokens_total, prompt_tokens as u64);
    Ok(receivers
        .into_iter()
        .zip(timers)
        .zip(0..)
        .map(|((receiver, timer), index)| {
            let outcome = Outcome {
                metrics: metrics.clone(),
                shard: shard.clone(),
                timer,
            };
            choice_events(
                index,
                receiver,
                tokenizer.clone(),
                settings.clone(),
                outcome,
            )
        })
        .collect())
}

/// Where a choice reports how it ended: the metrics, and the shard whose state says what a
/// failure was.
pub struct Outcome {
    pub metrics: Arc<Metrics>,
    pub shard: Arc<dyn ShardBackend>,
    /// The choice's latency and length histograms.
    pub timer: RequestTimer,
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
    settings: ChoiceSettings,
    mut outcome: Outcome,
) -> BoxStream<'static, ChoiceEvent> {
    let metrics = outcome.metrics.clone();
    // The EOS token's text is never shown (skip_special_tokens), even for tokenizers that do
    // not mark it special: an EOS event is not fed to the detokenizer at all.
    let mut detokenizer = IncrementalDetokenizer::new(tokenizer, !settings.keep_special_tokens);
    let mut stop = StopMatcher::new(settings.stop);
    let mut thinking = settings.reasoning.map(ReasoningCounter::new);
    async_stream::stream! {
        let mut pending = Vec::new();
        let mut generated = 0u32;
        let mut cached_tokens = 0u32;
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
            cached_tokens += event.cached_tokens;
            Metrics::add(&metrics.generated_tokens_total, 1);
            outcome.timer.token();
            if generated == 1 && settings.prompt_logprobs {
                yield ChoiceEvent::Prompt { index, positions: event.prompt_logprobs };
            }
            if settings.drop_generation {
                drop(receiver);
                Metrics::add(&metrics.requests_finished_total, 1);
                outcome.timer.finished(0);
                yield ChoiceEvent::Finish {
                    index,
                    reason: FinishReason::Length,
                    tokens: Vec::new(),
                    completion_tokens: 0,
                    reasoning_tokens: 0,
                    cached_tokens,
                };
                return;
            }
            pending.push(GeneratedToken {
                id: event.token_id,
                logprob: event.logprob,
                top: event.top_logprobs,
            });
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
            if let Some(counter) = &mut thinking {
                counter.token(&text);
            }
            let step = stop.push(&text);
            let mut text = step.text;
            let reason = if step.stopped {
                Some(FinishReason::Stop)
            } else {
                event.finish.map(|finish| match finish {
                    // A generation request never ends `Embedded`; were it to, it ended cleanly.
                    scheduler::FinishReason::Eos | scheduler::FinishReason::Embedded => {
                        FinishReason::Stop
                    }
                    scheduler::FinishReason::Length => FinishReason::Length,
                })
            };
            let Some(reason) = reason else {
                if !text.is_empty() {
                    yield ChoiceEvent::Text { index, text, tokens: std::mem::take(&mut pending) };
                }
                continue;
            };
            // Finished: let the scheduler free the request before anything else is sent.
            drop(receiver);
            Metrics::add(&metrics.requests_finished_total, 1);
            outcome.timer.finished(generated);
            if !step.stopped {
                text.push_str(&stop.finish());
            }
            if !text.is_empty() {
                yield ChoiceEvent::Text { index, text, tokens: std::mem::take(&mut pending) };
            }
            let reasoning_tokens = thinking.as_ref().map_or(0, ReasoningCounter::count);
            yield ChoiceEvent::Finish {
                index, reason, tokens: pending, completion_tokens: generated, reasoning_tokens,
                cached_tokens,
            };
            return;
        }
    }
    .boxed()
}

/// A finished choice, for non-streamed responses.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceOutput {
    pub text: String,
    pub tokens: Vec<GeneratedToken>,
    /// The prompt's logprobs, when asked.
    pub prompt: Option<Vec<PromptPosition>>,
    pub finish_reason: FinishReason,
    pub completion_tokens: u32,
    /// Of them, those it spent thinking (0 without a reasoning split).
    pub reasoning_tokens: u32,
    /// Prompt tokens the prefix cache supplied.
    pub cached_tokens: u32,
}

impl ChoiceOutput {
    /// The sum of the generated tokens' raw logprobs (what `best_of` ranks choices by).
    pub fn cumulative_logprob(&self) -> f64 {
        self.tokens
            .iter()
            .map(|token| f64::from(token.logprob))
            .sum()
    }
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
    let mut tokens = Vec::new();
    let mut prompt = None;
    while let Some(event) = events.next().await {
        match event {
            ChoiceEvent::Prompt { positions, .. } => prompt = Some(positions),
            ChoiceEvent::Text {
                text: new_text,
                tokens: new_tokens,
                ..
            } => {
                text.push_str(&new_text);
                tokens.extend(new_tokens);
            }
            ChoiceEvent::Finish {
                reason,
                tokens: new_tokens,
                completion_tokens,
                reasoning_tokens,
                cached_tokens,
                ..
            } => {
                tokens.extend(new_tokens);
                return Ok(ChoiceOutput {
                    text,
                    tokens,
                    prompt,
                    finish_reason: reason,
                    completion_tokens,
                    reasoning_tokens,
                    cached_tokens,
                });
            }
            ChoiceEvent::Failed(error) => return Err(error),
        }
    }
    Err(ApiError::Internal(
        "a choice ended without finishing".to_owned(),
    ))
}

/// `usage.prompt_tokens_details.cached_tokens` of a request whose choices come in groups of
/// `choices_per_prompt` per prompt: each prompt counts once, as in `prompt_tokens`, with what
/// its first choice found cached (its other choices share the blocks that one computes).
pub fn prompt_cached_tokens(cached_per_choice: &[u32], choices_per_prompt: usize) -> u32 {
    cached_per_choice
        .iter()
        .step_by(choices_per_prompt.max(1))
        .sum()
}
