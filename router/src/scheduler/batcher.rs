//! The continuous-batching loop: one task that owns the queue, the block allocator and the
//! running batch, so none of it needs a lock.
//!
//! Each step: admit what fits from the queue into a new Prefill batch (one token each), after
//! activating the adapters it needs in their device slots, then one Decode over [running
//! batch, new batch], which the shard merges into the running batch.
//! After every shard call each request's token goes to its channel; requests that finished
//! (EOS, length) or whose client left give their blocks back at once and leave the shard's batch
//! with FilterBatch. A failed shard call fails the requests of the batch it touched, clears that
//! state on the shard, and the loop carries on with the rest. Adapter activation and unloading
//! are in `batcher/adapters.rs`; preempting running requests for a starved queue head, and the
//! queue deadline, in `../preemption.rs`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use opentelemetry::KeyValue;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};
use tokio::time::Instant;

use super::blocks::{BlockAllocation, BlockAllocator};
use super::preemption::Starved;
use super::queue::{Admit, Keyed, Queue};
use super::slots::AdapterSlots;
use super::{
    FinishReason, Gauges, GenerationError, GenerationRequest, SchedulerConfig, TokenEvent,
    UnloadError,
};
use crate::pb;
use crate::shard::{ShardBackend, ShardError};
use crate::telemetry::{within_step, RequestTrace, StepSpan};

mod adapters;

use adapters::{Activation, PendingUnload};

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
}

/// What a request taken from the queue holds before its prefill.
struct Admission {
    blocks: BlockAllocation,
    /// Its adapter's device slot (`None` for the base model).
    slot: Option<usize>,
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
}

impl Running {
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

/// `draws_done`: tokens generated before a preemption, whose draws the shard's generator skips.
fn sampling_to_pb(request: &GenerationRequest, draws_done: u32) -> pb::SamplingParams {
    let s = &request.sampling;
    pb::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        seed: s.seed,
        draws_done,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s.logit_bias.iter().copied().collect(),
        top_logprobs: s.top_logprobs,
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
    /// Every request the shard holds KV for, by id.
    pub(super) active: HashMap<u64, Running>,
    /// The shard's running batch (all of `active` between steps).
    pub(super) running: Option<pb::CachedBatch>,
    next_batch_id: u64,
    pub(super) gauges: Arc<Gauges>,
    /// A queue head that waited past `preemption_wait` for blocks or a batch slot in the last
    /// step: room is made for it before the next one.
    pub(super) starved: Option<Starved>,
}

impl Batcher {
    pub(super) fn new(
        shard: Arc<dyn ShardBackend>,
        config: SchedulerConfig,
        incoming: mpsc::UnboundedReceiver<Command>,
        gauges: Arc<Gauges>,
    ) -> Self {
        Self {
            shard,
            resources: Resources {
                allocator: BlockAllocator::new(config.usable_blocks()),
                slots: AdapterSlots::new(config.max_active_adapters),
            },
            config,
            incoming,
            queue: Queue::new(),
            unloads: Vec::new(),
            active: HashMap::new(),
            running: None,
            next_batch_id: 0,
            gauges,
            starved: None,
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            while let Ok(command) = self.incoming.try_recv() {
                self.accept(command);
            }
            if !self.unloads.is_empty() {
                self.finish_unloads().await;
            }
            if self.running.is_none() && self.queue.is_empty() {
                // Idle: sleep until a command arrives, or stop once every handle is gone.
                if !self.wait_for_command().await {
                    break;
                }
                continue;
            }
            let waiting = self.queue.len();
            let new_batch = self.prefill_waiting().await;
            let stuck =
                new_batch.is_none() && self.running.is_none() && self.queue.len() == waiting;
            self.decode(new_batch).await;
            self.publish_gauges();
            if stuck {
                // Nothing runs, so every slot and block is free and some request should have
                // gone in. Should that ever fail, wait for news rather than spin on the CPU.
                tracing::error!(
                    queued = waiting,
                    "no queued request could be admitted while nothing runs"
                );
                if !self.wait_for_command().await {
                    break;
                }
            }
        }
        tracing::debug!("scheduler loop stopped: no handles left and nothing running");
    }

    /// Blocks until the next command and takes it; false once every handle is gone.
    async fn wait_for_command(&mut self) -> bool {
        self.publish_gauges();
        match self.incoming.recv().await {
            Some(command) => {
                self.accept(command);
                true
            }
            None => false,
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

    /// Prefills the waiting requests that fit; returns the new cached batch, if any is left
    /// after its first tokens.
    async fn prefill_waiting(&mut self) -> Option<pb::CachedBatch> {
        if self.queue.is_empty() {
            return None;
        }
        // A client that left while queued never reaches the shard.
        self.queue.retain(|entry| !entry.events.is_closed());
        self.expire_queued();
        if let Some(starved) = self.starved.take() {
            self.preempt_for(starved).await;
        }
        let queue = &self.queue;
        let slots = &mut self.resources.slots;
        slots.drop_reservations_unless(|adapter| queue.has_waiting(adapter));
        let max_batch_size = self.config.max_batch_size.max(1) as usize;
        let mut room = max_batch_size.saturating_sub(self.active.len());
        let token_budget = u64::from(self.config.max_batch_prefill_tokens);
        let mut prefill_tokens = 0u64;
        let mut admitted_count = 0usize;
        let mut activations = Vec::new();
        let mut waiting_for_slot = Vec::new();
        let mut starved = None;
        let patience = self.config.preemption_wait;
        let now = Instant::now();
        let Resources { allocator, slots } = &mut self.resources;
        let admitted = self.queue.next_batch(|entry| {
            let waited_too_long = now.duration_since(entry.queued_at) >= patience;
            if room == 0 {
                if waited_too_long {
                    starved = Some(Starved::new(entry.blocks_needed, true));
                }
                return Admit::Stop;
            }
            let prompt = entry.request.input_ids.len() as u64;
            // The first request of a batch goes in whatever its length, or it could never run.
            if admitted_count > 0 && prefill_tokens + prompt > token_budget {
                return Admit::Stop;
            }
            let adapter = entry.request.adapter_id.as_str();
            let slot = if adapter.is_empty() {
                None
            } else if let Some(slot) = slots.find(adapter) {
                Some(slot)
            } else {
                waiting_for_slot.push(adapter.to_owned());
                return Admit::Skip;
            };
            let Some(blocks) = allocator.allocate(entry.blocks_needed) else {
                if waited_too_long {
                    starved = Some(Starved::new(entry.blocks_needed, false));
                }
                return Admit::Stop;
            };
            if let Some(slot) = slot {
                if let Some(evicted) = slots.claim(slot, adapter) {
                    activations.push(Activation::new(slot, adapter, evicted));
                }
            }
            room -= 1;
            admitted_count += 1;
            prefill_tokens += prompt;
            Admit::Take(Admission { blocks, slot })
        });
        if !waiting_for_slot.is_empty() {
            slots.reserve(&waiting_for_slot);
        }
        self.starved = starved;
        let admitted = self.activate(activations, admitted).await;
        if admitted.is_empty() {
            return None;
        }

        let batch_id = self.next_batch_id;
        self.next_batch_id += 1;
        let mut ids = Vec::with_capacity(admitted.len());
        let mut requests = Vec::with_capacity(admitted.len());
        for (entry, Admission { blocks, slot }) in admitted {
            let Entry {
                id,
                request,
                events,
                queued_at,
                permit,
                resumed_after,
                trace,
                ..
            } = entry;
            if resumed_after == 0 {
                self.gauges
                    .observed
                    .queue_wait(&request.adapter_id, queued_at.elapsed());
            }
            if let Some(trace) = &trace {
                trace.admitted(resumed_after);
            }
            tracing::debug!(
                request_id = id,
                batch_id,
                queue_ms = queued_at.elapsed().as_millis() as u64,
                resumed_after,
                "request admitted"
            );
            requests.push(pb::Request {
                id,
                input_ids: request.input_ids.clone(),
                blocks: blocks.ids().to_vec(),
                sampling: Some(sampling_to_pb(&request, resumed_after)),
                max_new_tokens: request.max_new_tokens,
                adapter_id: request.adapter_id.clone(),
                // A resumed request reported its prompt's logprobs before it was preempted.
                prompt_logprobs: request.prompt_logprobs.filter(|_| resumed_after == 0),
                grammar: request.grammar.clone(),
                cached_tokens: 0,
                prefill_until: 0,
            });
            ids.push(id);
            self.active.insert(
                id,
                Running {
                    events,
                    blocks,
                    slot,
                    permit,
                    request,
                    tokens: Vec::new(),
                    admitted_at: Instant::now(),
                    resumed_after,
                    trace,
                },
            );
        }
        tracing::debug!(batch_id, size = ids.len(), prefill_tokens, "prefill");

        self.gauges.observed.prefill_batch(requests.len());
        let request = pb::PrefillRequest { batch_id, requests };
        self.gauges.prefill_steps.fetch_add(1, Ordering::Relaxed);
        let step = StepSpan::start(
            "prefill",
            || step_attributes(batch_id, ids.len(), prefill_tokens),
            ids.iter().filter_map(|id| self.traced(*id)),
        );
        let outcome = within_step(step.as_ref(), self.shard.prefill(request)).await;
        if let Some(step) = step {
            step.end(outcome.as_ref().err().map(|e| e as _));
        }
        match outcome {
            Ok(response) => {
                self.gauges.record_grammar(response.grammar_ns);
                self.on_generations(&response.generations);
                match response.batch {
                    Some(batch) if batch.request_ids.len() == ids.len() => {
                        self.drop_finished(batch).await
                    }
                    // A batch that lost requests would leave their blocks held for good.
                    _ => {
                        let error = protocol_error("Prefill did not return the whole batch");
                        self.fail_batch(batch_id, &ids, &error).await;
                        None
                    }
                }
            }
            Err(error) => {
                self.fail_batch(batch_id, &ids, &error).await;
                None
            }
        }
    }

    /// One decode step over the running batch and the newly prefilled one.
    async fn decode(&mut self, new_batch: Option<pb::CachedBatch>) {
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
        let outcome = within_step(
            step.as_ref(),
            self.shard.decode(pb::DecodeRequest { batches }),
        )
        .await;
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
                self.on_generations(&response.generations);
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
    fn on_generations(&mut self, generations: &[pb::Generation]) {
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
            let finish = running.finish_reason(generation.token_id);
            let event = TokenEvent {
                token_id: generation.token_id,
                logprob: generation.logprob,
                top_logprobs: generation.top_logprobs.iter().map(Into::into).collect(),
                prompt_logprobs: generation.prompt_logprobs.iter().map(Into::into).collect(),
                finish,
            };
            if finish.is_none() && running.events.send(Ok(event.clone())).is_ok() {
                continue;
            }
            // Finished, or the client is gone (its receiver was dropped).
            if let Some(running) = self.active.remove(&id) {
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
    async fn drop_finished(&mut self, mut batch: pb::CachedBatch) -> Option<pb::CachedBatch> {
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
        let request = pb::FilterBatchRequest {
            batch_id: batch.id,
            request_ids: batch.request_ids.clone(),
        };
        match self.shard.filter_batch(request).await {
            Ok(response) => Some(response.batch.unwrap_or(batch)),
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
        self.clear_cache(None).await;
    }

    /// Best effort: after a failure the batch may not exist on the shard any more.
    pub(super) async fn clear_cache(&self, batch_id: Option<u64>) {
        let request = pb::ClearCacheRequest { batch_id };
        if let Err(error) = self.shard.clear_cache(request).await {
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
