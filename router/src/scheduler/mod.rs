//! Admission, per-adapter queues, KV-block accounting and the continuous-batching loop.
//!
//! The contract with the HTTP layer: `Scheduler::submit` takes a validated
//! `GenerationRequest` and returns a receiver of `TokenEvent`s. Dropping the receiver (client
//! gone, stop string matched) cancels the request: it leaves the batch and its blocks are freed.
//!
//! Adapters: each adapter (the base model is "") has its own queue, served round robin
//! (`queue.rs`); the scheduler owns the shard's `max_active_adapters` device slots and activates
//! an adapter into one before prefilling its requests, evicting only idle adapters (`slots.rs`).
//! The adapter must already be loaded on the shards (the adapter registry does that).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::metrics::scheduler::SchedulerMetrics;
use crate::shard::{ShardBackend, ShardError};
use crate::telemetry::RequestTrace;

mod batcher;
mod blocks;
mod grammar_pin;
mod prefix_hash;
mod queue;
mod slots;

#[cfg(test)]
mod adapter_tests;
#[cfg(test)]
mod embed_tests;
#[cfg(test)]
mod fairness_tests;
#[cfg(test)]
mod pace_tests;
#[cfg(test)]
mod preemption_tests;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;

use batcher::{Batcher, Command, Entry};
pub use blocks::{blocks_for_tokens, BlockAllocation, BlockAllocator};
pub use grammar_pin::PinnedGrammar;
// The shard contract's value types, which requests carry and events report.
pub use crate::shard::{Grammar, GrammarKind, PromptPosition, SamplingParams, TokenLogprob};

/// A request that passed validation; the only thing the scheduler accepts.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub input_ids: Vec<u32>,
    pub max_new_tokens: u32,
    pub sampling: SamplingParams,
    /// Token ids that end generation with `finish_reason: "stop"` (unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The client's `stop_token_ids`: end generation like EOS, even with `ignore_eos` (as
    /// vLLM: the client asked for them by name).
    pub stop_token_ids: Vec<u32>,
    /// EOS and stop tokens are not honoured before this many tokens.
    pub min_tokens: u32,
    /// "" is the base model; otherwise an adapter loaded on the shards.
    pub adapter_id: String,
    /// The adapter's LoRA rank (LoadAdapter's answer), which picks the slot class; 0 when
    /// unknown: only slots of the largest capacity.
    pub adapter_rank: u32,
    /// Report the prompt's logprobs (with this many alternatives) on the first event.
    pub prompt_logprobs: Option<u32>,
    /// Constrains the output (structured output, tool calls); compiled and pinned on the shards
    /// before the request was queued (`Scheduler::pin_grammar`). EOS then ends the request even
    /// with `ignore_eos` or before `min_tokens`: the grammar allows nothing else once the
    /// output is complete.
    pub grammar: Option<Arc<PinnedGrammar>>,
    /// An embedding request: its whole prompt is computed in one Prefill and pooled, and its
    /// one event carries the embedding (`FinishReason::Embedded`). It never decodes, so it
    /// holds no batch slot (`max_batch_size`) and its KV blocks only for that one step; it
    /// is neither chunked nor served from the prefix cache (pooling reads every token's
    /// hidden state). `max_new_tokens` is 0 and the sampling fields are unused.
    pub embed: bool,
    /// Whose request it is: its turn in the queue and the cached prefixes it may reuse.
    pub scope: RequestScope,
}

/// Who a request belongs to, as scheduling sees it. Both parts are empty without API keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestScope {
    /// Tenants take turns inside each adapter's queue (`queue.rs`).
    pub tenant: String,
    /// Part of every prompt block's name (`prefix_hash.rs`): requests of different scopes
    /// never share a cached block, so no one can time a request to learn what another scope
    /// sent. The key's prefix-cache group, plus the request's `cache_salt` if it has one.
    pub cache_scope: String,
}

impl GenerationRequest {
    /// An embedding request for `input_ids` on `adapter_id` ("" is the base model) of LoRA
    /// rank `adapter_rank`.
    pub fn embedding(input_ids: Vec<u32>, adapter_id: &str, adapter_rank: u32) -> Self {
        Self {
            input_ids,
            max_new_tokens: 0,
            sampling: SamplingParams::default(),
            eos_token_ids: Vec::new(),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            adapter_id: adapter_id.to_owned(),
            adapter_rank,
            prompt_logprobs: None,
            grammar: None,
            embed: true,
            scope: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token was generated (it is the event's token, never shown as text).
    Eos,
    /// `max_new_tokens` reached.
    Length,
    /// An embedding request's one event: `TokenEvent::embedding` holds the result.
    Embedded,
}

/// One generated token; `finish` is set on the request's last event.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub token_id: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens at this step, most likely first.
    pub top_logprobs: Vec<TokenLogprob>,
    /// First event only, when the request asked `prompt_logprobs`: one entry per prompt token
    /// after the first.
    pub prompt_logprobs: Vec<PromptPosition>,
    pub finish: Option<FinishReason>,
    /// First event only: prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: u32,
    /// An embedding request's pooled embedding (its only event); empty for generation.
    pub embedding: Vec<f32>,
}

/// Why a running request failed (shard error, shutdown).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum GenerationError {
    #[error("shard error: {0}")]
    Shard(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// Waited in the queue longer than `--max-queue-wait-secs` without starting.
    #[error(
        "the request waited {waited_secs} s in the queue without starting \
         (--max-queue-wait-secs is {limit_secs}); retry later"
    )]
    QueueTimeout { waited_secs: u64, limit_secs: u64 },
}

/// Why a request was not admitted.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum AdmissionError {
    #[error(
        "the server is overloaded: it already has --max-concurrent-requests requests running \
         or queued; retry later"
    )]
    Overloaded,
    #[error("request needs {needed} KV blocks but the cache holds only {total}")]
    TooLarge { needed: u32, total: u32 },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// An adapter was asked for but the server has no adapter slots (`--max-active-adapters 0`).
    #[error(
        "adapter {adapter_id:?} requested, but adapters are disabled (--max-active-adapters is 0)"
    )]
    AdaptersDisabled { adapter_id: String },
}

/// Why `Scheduler::unload_adapter` did not unload.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum UnloadError {
    #[error("the base model is not an adapter and cannot be unloaded")]
    BaseModel,
    #[error("the shard could not unload the adapter: {0}")]
    Shard(ShardError),
    #[error("the scheduler has stopped")]
    Stopped,
}

pub type EventReceiver = mpsc::UnboundedReceiver<Result<TokenEvent, GenerationError>>;

/// Sizes the scheduler works within; the KV geometry comes from the shard's Warmup.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Blocks in the shard's cache.
    pub num_blocks: u32,
    /// Most prompt tokens in one Prefill (a single longer prompt is still admitted alone).
    pub max_batch_prefill_tokens: u32,
    /// If non-zero, at most this many KV token slots are handed out over all requests.
    pub max_batch_total_tokens: u32,
    /// Most requests in the running batch.
    pub max_batch_size: u32,
    /// Requests admitted at once, queued or running; beyond it `Overloaded`.
    pub max_concurrent_requests: u32,
    /// Longest prompt + completion; enforced by validation, kept here for reference.
    pub max_total_tokens: u32,
    /// Adapter device slots on the shard (Warmup's `max_active_adapters`); 0 disables adapters.
    pub max_active_adapters: u32,
    /// Each slot's largest LoRA rank, in slot order (Warmup's `slot_ranks`); empty: all slots
    /// alike.
    pub slot_ranks: Vec<u32>,
    /// How long the request at a queue head waits for blocks or a batch slot before running
    /// requests are preempted for it; also how long a request runs before it may be preempted.
    pub preemption_wait: Duration,
    /// Queued requests that have not started after this long fail with `QueueTimeout`.
    pub max_queue_wait: Option<Duration>,
    /// Share the KV of full prompt blocks between requests of the same adapter and prefix.
    pub prefix_caching: bool,
    /// Prefill prompts longer than a step's `max_batch_prefill_tokens` in chunks over several
    /// steps, each step also decoding the running requests.
    pub chunked_prefill: bool,
    /// While requests decode, size a step's prefill to take about this many times a decode
    /// step (`batcher/pace.rs`); 0: always up to `max_batch_prefill_tokens`.
    pub prefill_pace: f64,
    /// Run a step's prefill in the same shard call (and forward pass) as its decode when
    /// requests decode (`batcher/mixed.rs`); false: a Prefill call, then a Decode call.
    pub mixed_prefill: bool,
}

impl SchedulerConfig {
    /// The largest rank each adapter slot holds; slots all alike take whatever rank the shards
    /// loaded.
    fn slot_capacities(&self) -> Vec<u32> {
        if self.slot_ranks.is_empty() {
            return vec![u32::MAX; self.max_active_adapters as usize];
        }
        debug_assert_eq!(self.slot_ranks.len(), self.max_active_adapters as usize);
        self.slot_ranks.clone()
    }

    /// Blocks the scheduler hands out: the shard's cache, capped by `max_batch_total_tokens`.
    pub fn usable_blocks(&self) -> u32 {
        if self.max_batch_total_tokens == 0 {
            return self.num_blocks;
        }
        self.num_blocks
            .min(self.max_batch_total_tokens / self.block_size.max(1))
    }
}

/// A snapshot of the scheduler's load, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Admitted requests not yet finished (queued + running).
    pub in_flight: usize,
    /// Requests waiting for a batch slot or blocks.
    pub queued: usize,
    /// Requests in the running batch.
    pub running: usize,
    pub free_blocks: u32,
    pub total_blocks: u32,
    /// Adapter slots holding an adapter.
    pub active_adapters: usize,
    /// Adapter slots in all (`max_active_adapters`).
    pub adapter_slots: u32,
    /// Steps that prefilled and steps that decoded since start; a mixed step (a Decode that
    /// carried a Prefill) counts as both.
    pub prefill_steps: u64,
    pub decode_steps: u64,
    /// Running requests taken out of the batch to make room, since start.
    pub preemptions: u64,
    /// Steps whose batch had a grammar, and the time the shard spent on grammar masks in them.
    pub grammar_steps: u64,
    pub grammar_ns: u64,
    /// Prompt tokens looked up in the prefix cache since start, and those it had.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
}

/// Load figures the batcher publishes after every step (read without asking the loop).
#[derive(Debug, Default)]
struct Gauges {
    queued: AtomicUsize,
    running: AtomicUsize,
    free_blocks: AtomicU32,
    active_adapters: AtomicUsize,
    prefill_steps: AtomicU64,
    decode_steps: AtomicU64,
    preemptions: AtomicU64,
    grammar_steps: AtomicU64,
    grammar_ns: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    /// Histograms, adapter counters and the GIE adapter lists (shared with `/metrics`).
    observed: Arc<SchedulerMetrics>,
}

impl Gauges {
    /// A step's grammar-mask time, as the shard reported it (0: no grammar in the batch).
    fn record_grammar(&self, grammar_ns: u64) {
        if grammar_ns > 0 {
            self.grammar_steps.fetch_add(1, Ordering::Relaxed);
            self.grammar_ns.fetch_add(grammar_ns, Ordering::Relaxed);
        }
    }
}

/// Cheap, cloneable handle to the batching loop. The loop runs until every handle is dropped
/// and the requests it holds are done.
#[derive(Clone)]
pub struct Scheduler {
    inner: Arc<Inner>,
}

struct Inner {
    commands: mpsc::UnboundedSender<Command>,
    /// One permit per admitted request; an entry carries its permit, so however a request
    /// ends (finished, failed, cancelled, dropped) its slot comes back.
    permits: Arc<Semaphore>,
    config: SchedulerConfig,
    usable_blocks: u32,
    shutting_down: AtomicBool,
    next_request_id: AtomicU64,
    /// The last grammar id handed out (ids start at 1).
    last_grammar_id: AtomicU64,
    gauges: Arc<Gauges>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Scheduler {
    /// Spawns the batching loop on the current tokio runtime, recording what it sees into
    /// `metrics`.
    pub fn start_observed(
        shard: Arc<dyn ShardBackend>,
        config: SchedulerConfig,
        metrics: Arc<SchedulerMetrics>,
    ) -> Self {
        let (commands, incoming) = mpsc::unbounded_channel();
        let usable_blocks = config.usable_blocks();
        let gauges = Arc::new(Gauges {
            observed: metrics,
            ..Gauges::default()
        });
        gauges.free_blocks.store(usable_blocks, Ordering::Relaxed);
        let batcher = Batcher::new(shard, config.clone(), incoming, gauges.clone());
        tokio::spawn(batcher.run());
        tracing::info!(
            block_size = config.block_size,
            usable_blocks,
            max_batch_size = config.max_batch_size,
            max_batch_prefill_tokens = config.max_batch_prefill_tokens,
            max_concurrent_requests = config.max_concurrent_requests,
            max_active_adapters = config.max_active_adapters,
            slot_ranks = ?config.slot_ranks,
            prefill_pace = config.prefill_pace,
            mixed_prefill = config.mixed_prefill,
            "scheduler started"
        );
        Self {
            inner: Arc::new(Inner {
                commands,
                permits: Arc::new(Semaphore::new(config.max_concurrent_requests as usize)),
                config,
                usable_blocks,
                shutting_down: AtomicBool::new(false),
                next_request_id: AtomicU64::new(0),
                last_grammar_id: AtomicU64::new(0),
                gauges,
            }),
        }
    }

    /// Admits a request of one choice; see [`Scheduler::submit_all`]. Tests' shorthand.
    #[cfg(test)]
    pub fn submit(&self, request: GenerationRequest) -> Result<EventReceiver, AdmissionError> {
        let mut receivers = self.submit_all(vec![request])?;
        receivers.pop().ok_or(AdmissionError::ShuttingDown)
    }

    /// Admits the choices of one HTTP request together, or says at once why not. They share one
    /// `--max-concurrent-requests` permit, which comes back when the last of them ends.
    /// Dropping a receiver cancels that choice.
    pub fn submit_all(
        &self,
        requests: Vec<GenerationRequest>,
    ) -> Result<Vec<EventReceiver>, AdmissionError> {
        let inner = &self.inner;
        if inner.shutting_down.load(Ordering::Acquire) {
            return Err(AdmissionError::ShuttingDown);
        }
        let mut blocks = Vec::with_capacity(requests.len());
        for request in &requests {
            if !request.adapter_id.is_empty() && inner.config.max_active_adapters == 0 {
                return Err(AdmissionError::AdaptersDisabled {
                    adapter_id: request.adapter_id.clone(),
                });
            }
            let tokens = request.input_ids.len() as u64 + u64::from(request.max_new_tokens);
            let needed = blocks_for_tokens(tokens, inner.config.block_size);
            if needed > u64::from(inner.usable_blocks) {
                return Err(AdmissionError::TooLarge {
                    needed: u32::try_from(needed).unwrap_or(u32::MAX),
                    total: inner.usable_blocks,
                });
            }
            blocks.push(needed as u32);
        }
        let permit = Arc::new(
            inner
                .permits
                .clone()
                .try_acquire_owned()
                .map_err(|_| AdmissionError::Overloaded)?,
        );
        let mut receivers = Vec::with_capacity(requests.len());
        // The HTTP request's span, parent of each choice's queue wait (None when tracing is off).
        let trace = RequestTrace::current();
        for (request, needed) in requests.into_iter().zip(blocks) {
            let (events, receiver) = mpsc::unbounded_channel();
            let id = inner.next_request_id.fetch_add(1, Ordering::Relaxed);
            let mut entry = Entry::new(id, request, needed, events, permit.clone());
            entry.trace = trace.clone();
            // Fails only if the loop is gone; the entries (and the permit) go with the error.
            inner
                .commands
                .send(Command::Submit(Box::new(entry)))
                .map_err(|_| AdmissionError::ShuttingDown)?;
            tracing::debug!(request_id = id, blocks = needed, "request queued");
            receivers.push(receiver);
        }
        Ok(receivers)
    }

    /// A new pin for `grammar`: its id is for `ShardBackend::compile_grammar`, and the shards
    /// are told to release it once the pin and every request carrying it are gone.
    pub fn pin_grammar(&self, grammar: Grammar) -> Arc<PinnedGrammar> {
        let id = self.inner.last_grammar_id.fetch_add(1, Ordering::Relaxed) + 1;
        Arc::new(PinnedGrammar::new(id, grammar, self.inner.commands.clone()))
    }

    /// Stops admitting new requests; those already admitted run to completion.
    pub fn shutdown(&self) {
        if !self.inner.shutting_down.swap(true, Ordering::AcqRel) {
            tracing::info!(
                in_flight = self.in_flight(),
                "scheduler stops admitting requests"
            );
        }
    }

    /// Unloads an adapter from the shards once its queued and running requests have finished:
    /// its device slot is freed, then `UnloadAdapter` is sent. The request is made when this is
    /// called (requests submitted before it are served first); the returned future resolves when
    /// the shard answered, and dropping it does not cancel the unload. Refusing new requests for
    /// the adapter meanwhile is the adapter registry's job: the scheduler serves what it gets.
    pub fn unload_adapter(
        &self,
        adapter_id: String,
    ) -> impl Future<Output = Result<(), UnloadError>> + Send + 'static {
        let (done, outcome) = oneshot::channel();
        let sent = if adapter_id.is_empty() {
            Err(UnloadError::BaseModel)
        } else {
            self.inner
                .commands
                .send(Command::Unload { adapter_id, done })
                .map_err(|_| UnloadError::Stopped)
        };
        async move {
            sent?;
            outcome.await.unwrap_or(Err(UnloadError::Stopped))
        }
    }

    /// Admitted requests that have not finished yet (queued + running).
    pub fn in_flight(&self) -> usize {
        let max = self.inner.config.max_concurrent_requests as usize;
        max.saturating_sub(self.inner.permits.available_permits())
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.inner.config
    }

    pub fn stats(&self) -> SchedulerStats {
        let gauges = &self.inner.gauges;
        SchedulerStats {
            in_flight: self.in_flight(),
            queued: gauges.queued.load(Ordering::Relaxed),
            running: gauges.running.load(Ordering::Relaxed),
            free_blocks: gauges.free_blocks.load(Ordering::Relaxed),
            total_blocks: self.inner.usable_blocks,
            active_adapters: gauges.active_adapters.load(Ordering::Relaxed),
            adapter_slots: self.inner.config.max_active_adapters,
            prefill_steps: gauges.prefill_steps.load(Ordering::Relaxed),
            decode_steps: gauges.decode_steps.load(Ordering::Relaxed),
            preemptions: gauges.preemptions.load(Ordering::Relaxed),
            grammar_steps: gauges.grammar_steps.load(Ordering::Relaxed),
            grammar_ns: gauges.grammar_ns.load(Ordering::Relaxed),
            prefix_cache_queries: gauges.prefix_queries.load(Ordering::Relaxed),
            prefix_cache_hits: gauges.prefix_hits.load(Ordering::Relaxed),
        }
    }
}
