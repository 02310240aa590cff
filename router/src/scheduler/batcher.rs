//! The continuous-batching loop: one task that owns the queue, the block allocator and the
//! running batch, so none of it needs a lock.
//!
//! Each step: the prefill is planned (`batcher/prefill.rs`: the next chunks of prompts under
//! way, then what fits from the queue whose adapter is in a device slot; slots for the others
//! are filled beside the steps). While requests decode, one Decode of the running batch carries
//! it (`batcher/mixed.rs`, `--mixed-prefill`): one forward pass, whose finished prompts join the
//! running batch. Otherwise (nothing decodes yet, or `--mixed-prefill false`) one Prefill call,
//! then one Decode over [running batch, the requests whose prompt is done], which the shard
//! merges into the running batch.
//! After every shard call each request's token goes to its channel; requests that finished
//! (EOS, length) or whose client left give their blocks back at once and leave the shard's batch
//! with FilterBatch. A failed shard call fails the requests of the batch it touched, clears that
//! state on the shard, and the loop carries on with the rest. Adapter activation and unloading
//! are in `batcher/adapters.rs`; preempting running requests for a starved queue head, and the
//! queue deadline, in `batcher/preemption.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use opentelemetry::KeyValue;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::blocks::{BlockAllocation, BlockAllocator, BlockHash};
use super::queue::{Keyed, Queue};
use super::slots::AdapterSlots;
use super::{
    FinishReason, Gauges, GenerationError, GenerationRequest, SchedulerConfig, TokenEvent,
    UnloadError,
};
use crate::shard::{CachedBatch, Generation, ShardBackend, ShardError};
use crate::telemetry::{within_step, RequestTrace, StepSpan};

mod adapters;
mod mixed;
mod pace;
mod preemption;
mod prefill;
mod prefill_share;

use adapters::{Activated, PendingUnload};
use pace::PrefillPace;
use preemption::Starved;

type EventSender = mpsc::UnboundedSender<Result<TokenEvent, GenerationError>>;
/// The `--max-concurrent-requests` permit of one HTTP request, shared by its choices.
pub(super) type Permit = Arc<OwnedSemaphorePermit>;

/// What the `Scheduler` handles send to the loop. One channel for both keeps them in order: a
/// request submitted before an unload is queued before the unload is looked at.
pub(super) enum Command {
    Submit(Box<Entry>),
    /// Unload the adapter once none of its requests is queued or running.
    Unload {
        adapter_id: String,
        done: oneshot::Sender<Result<(), UnloadError>>,
    },
    /// No request uses this pinned grammar any more.
    ReleaseGrammar(u64),
}

/// An admitted request waiting in the queue.
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) request: GenerationRequest,
    pub(super) blocks_needed: u32,
    pub(super) events: EventSender,
    /// When it joined the queue (again, for a preempted request).
    pub(super) queued_at: Instant,
    pub(super) permit: Permit,
    /// Tokens generated before it was preempted: it resumes, and has streamed already, so the
    /// queue deadline no longer applies to it.
    pub(super) resumed_after: u32,
    /// Its request's trace (None when tracing is off).
    pub(super) trace: Option<RequestTrace>,
    /// Names of its prompt's full blocks for the prefix cache (empty when that is off); set by
    /// the batcher when the entry is queued.
    pub(super) block_hashes: Vec<BlockHash>,
}

impl Entry {
    pub(super) fn new(
        id: u64,
        request: GenerationRequest,
        blocks_needed: u32,
        events: EventSender,
        permit: Permit,
    ) -> Self {
        Self {
            id,
            request,
            blocks_needed,
            events,
            queued_at: Instant::now(),
            permit,
            resumed_after: 0,
            trace: None,
            block_hashes: Vec::new(),
        }
    }

    /// Fails a request that never reached the shard; its admission slot comes back first.
    fn fail(self, message: &str) {
        let Self { events, permit, .. } = self;
        drop(permit);
        let _ = events.send(Err(GenerationError::Shard(message.to_owned())));
    }
}

impl Keyed for Entry {
    fn key(&self) -> &str {
        &self.request.adapter_id
    }

    fn tenant(&self) -> &str {
        &self.request.scope.tenant
    }

    fn decodes(&self) -> bool {
        !self.request.embed
    }
}

/// What a request taken from the queue holds before its prefill.
struct Admission {
    blocks: BlockAllocation,
    /// Its adapter's device slot (`None` for the base model).
    slot: Option<usize>,
    /// Leading prompt tokens found in the prefix cache (whole blocks).
    cached_tokens: u32,
    /// End of the prompt part this step computes (the whole prompt unless chunked).
    prefill_until: u32,
}

/// A request whose KV lives in the shard.
pub(super) struct Running {
    pub(super) events: EventSender,
    pub(super) blocks: BlockAllocation,
    /// Its adapter's device slot, held until the request ends.
    pub(super) slot: Option<usize>,
    pub(super) permit: Permit,
    /// What was prefilled (`input_ids` is the prompt, plus the tokens of earlier runs for a
    /// resumed request); kept so a preempted request can be queued again.
    pub(super) request: GenerationRequest,
    /// Tokens generated since this prefill.
    pub(super) tokens: Vec<u32>,
    pub(super) admitted_at: Instant,
    /// Tokens generated before this prefill (see `Entry::resumed_after`).
    pub(super) resumed_after: u32,
    pub(super) trace: Option<RequestTrace>,
    /// Prompt tokens whose KV the shard has (or computes in the step under way); below the
    /// prompt's length while its prefill goes on in chunks (it is then in `prefilling`, not in
    /// the shard's batch).
    pub(super) prefilled: u32,
    /// Prompt tokens the prefix cache supplied at admission (reported in `usage`).
    pub(super) cached_tokens: u32,
    pub(super) block_hashes: Vec<BlockHash>,
}

impl Running {
    fn prompt_len(&self) -> u32 {
        self.request.input_ids.len() as u32
    }

    /// Whether `token`, the request's latest token, ends it. EOS and stop tokens count only
    /// once at least `min_tokens` tokens came before them (as vLLM's `min_tokens`);
    /// `ignore_eos` ignores EOS, not the stop tokens the client named. One that is also the
    /// last allowed token reports `Eos`, the more specific reason. Under a grammar, EOS is
    /// only possible once the output is complete, and then nothing else is: it always ends.
    fn finish_reason(&self, token: u32) -> Option<FinishReason> {
        let generated = self.tokens.len() as u32;
        let request = &self.request;
        let eos = request.eos_token_ids.contains(&token);
        if eos && request.grammar.is_some() {
            return Some(FinishReason::Eos);
        }
        let stops = request.stop_token_ids.contains(&token) || (!request.ignore_eos && eos);
        if stops && generated > request.min_tokens {
            Some(FinishReason::Eos)
        } else if generated >= request.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

/// What requests hold while they run: KV blocks and adapter slots.
pub(super) struct Resources {
    pub(super) allocator: BlockAllocator,
    pub(super) slots: AdapterSlots,
}

impl Resources {
    /// Gives a request's blocks, adapter slot and admission slot back; returns its channel for a
    /// last message. Resources go first so that a client that sees its last event also sees
    /// them released.
    fn release(&mut self, running: Running) -> EventSender {
        self.allocator.free(running.blocks);
        if let Some(slot) = running.slot {
            self.slots.release(slot);
        }
        drop(running.permit);
        running.events
    }
}

pub(super) struct Batcher {
    pub(super) shard: Arc<dyn ShardBackend>,
    pub(super) config: SchedulerConfig,
    incoming: mpsc::UnboundedReceiver<Command>,
    pub(super) queue: Queue<Entry>,
    pub(super) resources: Resources,
    /// Adapters to unload once their requests are done.
    unloads: Vec<PendingUnload>,
    /// Pinned grammars to release on the shards before the next step.
    grammar_releases: Vec<u64>,
    /// Every request the shard holds KV for, by id.
    pub(super) active: HashMap<u64, Running>,
    /// The shard's running batch (between steps, all of `active` but `prefilling`).
    pub(super) running: Option<CachedBatch>,
    /// Active requests whose prompt is prefilled in chunks and not done yet, oldest first;
    /// they are in no shard batch.
    pub(super) prefilling: Vec<u64>,
    /// Blocks the step under way registered in the prefix cache.
    step_registered: Vec<u32>,
    /// How many times each adapter id was unloaded: part of its blocks' prefix-cache names.
    pub(super) adapter_epochs: HashMap<String, u64>,
    next_batch_id: u64,
    pub(super) gauges: Arc<Gauges>,
    /// A queue head that waited past `preemption_wait` for blocks or a batch slot in the last
    /// step: room is made for it before the next one.
    starved: Option<Starved>,
    /// What steps cost, to size prefill chunks while requests decode.
    pace: PrefillPace,
    /// ActivateAdapter tasks report here (`batcher/adapters.rs`).
    activated_sender: mpsc::UnboundedSender<Activated>,
    activated: mpsc::UnboundedReceiver<Activated>,
    /// Adapters waiting for a slot whose host copy the shards were asked to warm.
    prefetched: HashSet<String>,
}

impl Batcher {
    pub(super) fn new(
        shard: Arc<dyn ShardBackend>,
        config: SchedulerConfig,
        incoming: mpsc::UnboundedReceiver<Command>,
        gauges: Arc<Gauges>,
    ) -> Self {
        let (activated_sender, activated) = mpsc::unbounded_channel();
        Self {
            shard,
            resources: Resources {
                allocator: BlockAllocator::new(config.usable_blocks()),
                slots: AdapterSlots::new(&config.slot_capacities()),
            },
            pace: PrefillPace::new(config.prefill_pace),
            config,
            incoming,
            queue: Queue::new(),
            unloads: Vec::new(),
            grammar_releases: Vec::new(),
            active: HashMap::new(),
            running: None,
            prefilling: Vec::new(),
            step_registered: Vec::new(),
            adapter_epochs: HashMap::new(),
            next_batch_id: 0,
            gauges,
            starved: None,
            activated_sender,
            activated,
            prefetched: HashSet::new(),
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            while let Ok(command) = self.incoming.try_recv() {
                self.accept(command);
            }
            self.finish_activations();
            if !self.unloads.is_empty() {
                self.finish_unloads().await;
            }
            if !self.grammar_releases.is_empty() {
                self.release_grammars().await;
            }
            if self.running.is_none() && self.queue.is_empty() && self.prefilling.is_empty() {
                // Idle: sleep until a command arrives, or stop once every handle is gone.
                if !self.wait_for_command().await {
                    break;
                }
                continue;
            }
            let waiting = self.queue.len();
            let planned = self.plan_prefill().await;
            let mixed = planned.is_some() && self.config.mixed_prefill && self.running.is_some();
            let new_batch = match planned {
                Some(plan) if mixed => {
                    self.mixed_step(plan).await;
                    None
                }
                Some(plan) => self.prefill(plan).await,
                None => None,
            };
            let stuck = !mixed
                && new_batch.is_none()
                && self.running.is_none()
                && self.prefilling.is_empty()
                && self.queue.len() == waiting;
            if !mixed {
                self.decode(new_batch).await;
            }
            self.publish_gauges();
            if stuck {
                // Nothing runs, so every slot and block is free and some request should have
                // gone in, unless its adapter's slot is still being filled. Should that ever
                // fail, wait for news rather than spin on the CPU.
                if self.resources.slots.activating_count() == 0 {
                    tracing::error!(
                        queued = waiting,
                        "no queued request could be admitted while nothing runs"
                    );
                }
                if !self.wait_for_command().await {
                    break;
                }
            }
        }
        tracing::debug!("scheduler loop stopped: no handles left and nothing running");
    }

    /// Blocks until the next command or activation report and takes it; false once every
    /// handle is gone.
    async fn wait_for_command(&mut self) -> bool {
        self.publish_gauges();
        tokio::select! {
            command = self.incoming.recv() => match command {
                Some(command) => {
                    self.accept(command);
                    true
                }
                None => false,
            },
            // Never closed: the loop holds a sender too.
            Some(report) = self.activated.recv() => {
                self.on_activated(report);
                true
            }
        }
    }

    fn publish_gauges(&self) {
        let gauges = &self.gauges;
        gauges.queued.store(self.queue.len(), Ordering::Relaxed);
        gauges.running.store(self.active.len(), Ordering::Relaxed);
        gauges
            .free_blocks
            .store(self.resources.allocator.free_count(), Ordering::Relaxed);
        gauges
            .active_adapters
            .store(self.resources.slots.active_count(), Ordering::Relaxed);
        if self.config.max_active_adapters > 0 {
            gauges.observed.publish_lora(
                self.resources.slots.adapters(),
                self.queue
                    .keys()
                    .filter(|k| !k.is_empty())
                    .map(str::to_owned)
                    .collect(),
            );
        }
    }

    /// One decode step over the running batch and the newly prefilled one.
    async fn decode(&mut self, new_batch: Option<CachedBatch>) {
        let mut batches = Vec::with_capacity(2);
        batches.extend(self.running.take());
        batches.extend(new_batch);
        if batches.is_empty() {
            return;
        }
        self.gauges.decode_steps.fetch_add(1, Ordering::Relaxed);
        let size = batches.iter().map(|b| b.request_ids.len()).sum();
        self.gauges.observed.decode_batch(size);
        let step = StepSpan::start(
            "decode",
            || step_attributes(batches[0].id, self.active.len(), 0),
            self.active
                .iter()
                .filter_map(|(id, running)| Some((*id, running.trace.as_ref()?))),
        );
        let started = Instant::now();
        let outcome = within_step(step.as_ref(), self.shard.decode(batches)).await;
        if outcome.is_ok() {
            self.pace.record_decode(started.elapsed());
        }
        if let Some(step) = step {
            step.end(outcome.as_ref().err().map(|e| e as _));
        }
        match outcome {
            Ok(response) => {
                tracing::trace!(
                    size = response.generations.len(),
                    forward_us = response.forward_ns / 1000,
                    grammar_us = response.grammar_ns / 1000,
                    "decode step"
                );
                self.gauges.record_grammar(response.grammar_ns);
                self.on_generations(response.generations);
                match response.batch {
                    Some(batch) => self.running = self.drop_finished(batch).await,
                    None => {
                        self.fail_all(&protocol_error("Decode returned no batch"))
                            .await
                    }
                }
            }
            // Every live request was in this call, and the shard's state is unknown now.
            Err(error) => self.fail_all(&error).await,
        }
    }

    /// A running request's trace, for the step spans.
    fn traced(&self, id: u64) -> Option<(u64, &RequestTrace)> {
        Some((id, self.active.get(&id)?.trace.as_ref()?))
    }

    /// Sends each generated token to its request; finished requests are released here.
    fn on_generations(&mut self, generations: Vec<Generation>) {
        for generation in generations {
            let id = generation.request_id;
            let Some(running) = self.active.get_mut(&id) else {
                tracing::warn!(
                    request_id = id,
                    "shard returned a token for an unknown request"
                );
                continue;
            };
            running.tokens.push(generation.token_id);
            let finish = if running.request.embed {
                Some(FinishReason::Embedded)
            } else {
                running.finish_reason(generation.token_id)
            };
            let first = running.tokens.len() == 1 && running.resumed_after == 0;
            let event = TokenEvent {
                cached_tokens: if first { running.cached_tokens } else { 0 },
                token_id: generation.token_id,
                logprob: generation.logprob,
                top_logprobs: generation.top_logprobs,
                prompt_logprobs: generation.prompt_logprobs,
                finish,
                embedding: generation.embedding,
            };
            if finish.is_none() && running.events.send(Ok(event.clone())).is_ok() {
                continue;
            }
            // Finished, or the client is gone (its receiver was dropped).
            if let Some(running) = self.active.remove(&id) {
                self.cache_output(&running);
                let events = self.resources.release(running);
                if let Some(reason) = finish {
                    tracing::debug!(request_id = id, ?reason, "request finished");
                    // The client may have left already; nothing to do then.
                    let _ = events.send(Ok(event));
                } else {
                    tracing::debug!(request_id = id, "client gone; request cancelled");
                }
            }
        }
    }

    /// Takes requests that are no longer active (finished, or client gone) out of `batch` on
    /// the shard. Returns what is left of the batch, `None` if nothing is.
    async fn drop_finished(&mut self, mut batch: CachedBatch) -> Option<CachedBatch> {
        // Clients that left without a failed send this step (e.g. between steps).
        for id in &batch.request_ids {
            if self.active.get(id).is_some_and(|r| r.events.is_closed()) {
                if let Some(running) = self.active.remove(id) {
                    tracing::debug!(request_id = id, "client gone; request cancelled");
                    self.resources.release(running);
                }
            }
        }
        let before = batch.request_ids.len();
        batch.request_ids.retain(|id| self.active.contains_key(id));
        if batch.request_ids.len() == before {
            return Some(batch);
        }
        if batch.request_ids.is_empty() {
            self.clear_cache(Some(batch.id)).await;
            return None;
        }
        let filter = self.shard.filter_batch(batch.id, batch.request_ids.clone());
        match filter.await {
            Ok(kept) => Some(kept.unwrap_or(batch)),
            Err(error) => {
                self.fail_batch(batch.id, &batch.request_ids, &error).await;
                None
            }
        }
    }

    /// Fails the listed requests of one batch and drops the batch on the shard.
    pub(super) async fn fail_batch(
        &mut self,
        batch_id: u64,
        request_ids: &[u64],
        error: &ShardError,
    ) {
        tracing::error!(batch_id, size = request_ids.len(), %error, "shard call failed; failing its batch");
        let message = error.to_string();
        for id in request_ids {
            if let Some(running) = self.active.remove(id) {
                let events = self.resources.release(running);
                let _ = events.send(Err(GenerationError::Shard(message.clone())));
            }
        }
        self.clear_cache(Some(batch_id)).await;
    }

    /// Fails every running request and clears the shard's whole cache.
    async fn fail_all(&mut self, error: &ShardError) {
        tracing::error!(size = self.active.len(), %error, "shard call failed; failing the running batch");
        let message = error.to_string();
        for (_, running) in self.active.drain() {
            let events = self.resources.release(running);
            let _ = events.send(Err(GenerationError::Shard(message.clone())));
        }
        self.running = None;
        self.prefilling.clear();
        self.clear_cache(None).await;
    }

    /// Unpins the grammars no request uses any more. Best effort: a shard that cannot answer
    /// has failed its batches already, and a pin it keeps costs memory, not correctness.
    async fn release_grammars(&mut self) {
        let ids = std::mem::take(&mut self.grammar_releases);
        if let Err(error) = self.shard.release_grammars(ids).await {
            tracing::warn!(%error, "ReleaseGrammars failed");
        }
    }

    /// Best effort: after a failure the batch may not exist on the shard any more.
    pub(super) async fn clear_cache(&self, batch_id: Option<u64>) {
        if let Err(error) = self.shard.clear_cache(batch_id).await {
            tracing::warn!(?batch_id, %error, "ClearCache failed");
        }
    }
}

/// What a step span records besides its timing.
fn step_attributes(batch_id: u64, requests: usize, prefill_tokens: u64) -> Vec<KeyValue> {
    let mut attributes = vec![
        KeyValue::new("quiver.batch_id", batch_id as i64),
        KeyValue::new("quiver.batch_size", requests as i64),
    ];
    if prefill_tokens > 0 {
        attributes.push(KeyValue::new(
            "quiver.prefill_tokens",
            prefill_tokens as i64,
        ));
    }
    attributes
}

fn protocol_error(message: &str) -> ShardError {
    ShardError::Status {
        rank: 0,
        code: tonic::Code::Internal,
        message: message.to_string(),
    }
}
