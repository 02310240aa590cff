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

use super::blocks::{BlockAllocation, BlockAllocator, BlockHash};
use super::preemption::Starved;
use super::prefix_hash::block_hashes;
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
    /// The shard's running batch (between steps, all of `active` but `prefilling`).
    pub(super) running: Option<pb::CachedBatch>,
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
            prefilling: Vec::new(),
            step_registered: Vec::new(),
            adapter_epochs: HashMap::new(),
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
            if self.running.is_none() && self.queue.is_empty() && self.prefilling.is_empty() {
                // Idle: sleep until a command arrives, or stop once every handle is gone.
                if !self.wait_for_command().await {
                    break;
                }
                continue;
            }
            let waiting = self.queue.len();
            let new_batch = self.prefill_waiting().await;
            let stuck = new_batch.is_none()
                && self.running.is_none()
                && self.prefilling.is_empty()
                && self.queue.len() == waiting;
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

    /// Runs one Prefill: the next chunks of prompts whose prefill goes on, then the waiting
    /// requests that fit, within `max_batch_prefill_tokens` computed tokens (prefix-cache hits
    /// are not computed). Returns the new cached batch of the requests whose prompt is done, if
    /// any is left after its first token.
    async fn prefill_waiting(&mut self) -> Option<pb::CachedBatch> {
        self.drop_gone_prefilling();
        if self.queue.is_empty() && self.prefilling.is_empty() {
            return None;
        }
        // A client that left while queued never reaches the shard.
        self.queue.retain(|entry| !entry.events.is_closed());
        self.expire_queued();
        if let Some(starved) = self.starved.take() {
            self.preempt_for(starved).await;
        }
        self.step_registered.clear();
        let mut budget = u64::from(self.config.max_batch_prefill_tokens.max(1));
        let chunks = self.next_chunks(&mut budget);
        let admitted = self.admit_waiting(budget, !chunks.is_empty()).await;
        if admitted.is_empty() && chunks.is_empty() {
            return None;
        }

        let batch_id = self.next_batch_id;
        self.next_batch_id += 1;
        let mut ids = Vec::with_capacity(chunks.len() + admitted.len());
        let mut requests = Vec::with_capacity(ids.capacity());
        let mut prefill_tokens = 0u64;
        for (id, from, until) in chunks {
            let running = &self.active[&id];
            requests.push(running.to_pb(id, from, until));
            prefill_tokens += u64::from(until - from);
            ids.push(id);
        }
        for (entry, admission) in admitted {
            let id = entry.id;
            let running = self.start_running(entry, admission);
            requests.push(running.to_pb(id, running.cached_tokens, running.prefilled));
            prefill_tokens += u64::from(running.prefilled - running.cached_tokens);
            if running.prefilled < running.prompt_len() {
                self.prefilling.push(id);
            }
            self.active.insert(id, running);
            ids.push(id);
        }
        let finals: Vec<u64> = requests
            .iter()
            .filter(|r| r.prefill_until == 0)
            .map(|r| r.id)
            .collect();
        tracing::debug!(
            batch_id,
            size = ids.len(),
            finals = finals.len(),
            prefill_tokens,
            "prefill"
        );

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
        let error = match outcome {
            Ok(response) => {
                self.prefilling.retain(|id| !finals.contains(id));
                self.gauges.record_grammar(response.grammar_ns);
                self.on_generations(&response.generations);
                match response.batch {
                    Some(batch) if batch.request_ids == finals => {
                        if finals.is_empty() {
                            return None;
                        }
                        return self.drop_finished(batch).await;
                    }
                    None if finals.is_empty() => return None,
                    // A batch that lost requests would leave their blocks held for good.
                    _ => protocol_error("Prefill did not return the batch of finished prompts"),
                }
            }
            Err(error) => error,
        };
        // What this step registered in the prefix cache was never computed.
        for block in std::mem::take(&mut self.step_registered) {
            self.resources.allocator.unregister(block);
        }
        self.prefilling.retain(|id| !ids.contains(id));
        self.fail_batch(batch_id, &ids, &error).await;
        None
    }

    /// The next chunk of each prompt whose prefill goes on, oldest first, within `budget`:
    /// (request id, from, until).
    fn next_chunks(&mut self, budget: &mut u64) -> Vec<(u64, u32, u32)> {
        let mut chunks = Vec::new();
        for &id in &self.prefilling {
            if *budget == 0 {
                break;
            }
            let running = self
                .active
                .get_mut(&id)
                .expect("prefilling requests are active");
            let from = running.prefilled;
            let take = u64::from(running.prompt_len() - from).min(*budget) as u32;
            running.prefilled = from + take;
            *budget -= u64::from(take);
            register_computed(
                &mut self.resources.allocator,
                &mut self.step_registered,
                running.blocks.ids(),
                &running.block_hashes,
                from,
                from + take,
                self.config.block_size,
            );
            chunks.push((id, from, from + take));
        }
        chunks
    }

    /// Takes the waiting requests that fit into this step (`budget` computed prompt tokens
    /// left; `busy`: chunks of earlier prompts are in it already) and activates their adapters.
    async fn admit_waiting(&mut self, budget: u64, busy: bool) -> Vec<(Entry, Admission)> {
        if self.queue.is_empty() {
            return Vec::new();
        }
        let queue = &self.queue;
        let slots = &mut self.resources.slots;
        slots.drop_reservations_unless(|adapter| queue.has_waiting(adapter));
        let max_batch_size = self.config.max_batch_size.max(1) as usize;
        let mut room = max_batch_size.saturating_sub(self.active.len());
        let mut budget_left = budget;
        let mut admitted_count = usize::from(busy);
        let mut activations = Vec::new();
        let mut waiting_for_slot = Vec::new();
        let mut starved = None;
        let patience = self.config.preemption_wait;
        let block_size = self.config.block_size.max(1);
        let chunked = self.config.chunked_prefill;
        let now = Instant::now();
        let Resources { allocator, slots } = &mut self.resources;
        let registered = &mut self.step_registered;
        let (mut queried, mut hit) = (0u64, 0u64);
        let admitted = self.queue.next_batch(|entry| {
            let waited_too_long = now.duration_since(entry.queued_at) >= patience;
            if room == 0 {
                if waited_too_long {
                    starved = Some(Starved::new(entry.blocks_needed, true));
                }
                return Admit::Stop;
            }
            if budget_left == 0 {
                return Admit::Stop;
            }
            let request = &entry.request;
            let prompt = request.input_ids.len() as u32;
            // At least the last prompt token is computed: its logits give the first token. A
            // request that wants the prompt's logprobs computes every prompt token.
            let reusable: &[BlockHash] = if request.prompt_logprobs.is_some() {
                &[]
            } else {
                let most = ((prompt - 1) / block_size) as usize;
                &entry.block_hashes[..most.min(entry.block_hashes.len())]
            };
            let cached = allocator.cached_prefix_len(reusable) * block_size;
            let needed = u64::from(prompt - cached);
            // Prompt logprobs come from one pass over the whole prompt: never chunked.
            let chunkable = chunked && request.prompt_logprobs.is_none();
            let until = if needed <= budget_left {
                prompt
            } else if chunkable {
                cached + budget_left as u32
            } else if admitted_count == 0 {
                // The first request of a step goes in whatever its length, or it never could.
                prompt
            } else {
                return Admit::Stop;
            };
            let adapter = request.adapter_id.as_str();
            let slot = if adapter.is_empty() {
                None
            } else if let Some(slot) = slots.find(adapter) {
                Some(slot)
            } else {
                waiting_for_slot.push(adapter.to_owned());
                return Admit::Skip;
            };
            let Some((blocks, hits)) =
                allocator.allocate_with_prefix(reusable, entry.blocks_needed)
            else {
                if waited_too_long {
                    starved = Some(Starved::new(entry.blocks_needed, false));
                }
                return Admit::Stop;
            };
            debug_assert_eq!(hits * block_size, cached);
            if let Some(slot) = slot {
                if let Some(evicted) = slots.claim(slot, adapter) {
                    activations.push(Activation::new(slot, adapter, evicted));
                }
            }
            if !entry.block_hashes.is_empty() && request.prompt_logprobs.is_none() {
                queried += u64::from(prompt);
                hit += u64::from(cached);
            }
            register_computed(
                allocator,
                registered,
                blocks.ids(),
                &entry.block_hashes,
                cached,
                until,
                block_size,
            );
            room -= 1;
            admitted_count += 1;
            budget_left = budget_left.saturating_sub(u64::from(until - cached));
            Admit::Take(Admission {
                blocks,
                slot,
                cached_tokens: cached,
                prefill_until: until,
            })
        });
        if !waiting_for_slot.is_empty() {
            slots.reserve(&waiting_for_slot);
        }
        self.starved = starved;
        self.gauges
            .prefix_queries
            .fetch_add(queried, Ordering::Relaxed);
        self.gauges.prefix_hits.fetch_add(hit, Ordering::Relaxed);
        self.activate(activations, admitted).await
    }

    /// A request taken from the queue, as the batcher keeps it from its first prefill on.
    fn start_running(&self, entry: Entry, admission: Admission) -> Running {
        let Entry {
            id,
            request,
            events,
            queued_at,
            permit,
            resumed_after,
            trace,
            block_hashes,
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
            queue_ms = queued_at.elapsed().as_millis() as u64,
            resumed_after,
            cached_tokens = admission.cached_tokens,
            "request admitted"
        );
        Running {
            events,
            blocks: admission.blocks,
            slot: admission.slot,
            permit,
            request,
            tokens: Vec::new(),
            admitted_at: Instant::now(),
            resumed_after,
            trace,
            prefilled: admission.prefill_until,
            cached_tokens: admission.cached_tokens,
            block_hashes,
        }
    }

    /// Releases the requests mid-prefill whose client left (they are in no shard batch).
    fn drop_gone_prefilling(&mut self) {
        let active = &self.active;
        let gone: Vec<u64> = self
            .prefilling
            .iter()
            .copied()
            .filter(|id| active.get(id).is_some_and(|r| r.events.is_closed()))
            .collect();
        for id in gone {
            self.prefilling.retain(|&p| p != id);
            if let Some(running) = self.active.remove(&id) {
                tracing::debug!(
                    request_id = id,
                    "client gone mid-prefill; request cancelled"
                );
                self.resources.release(running);
            }
        }
    }

    /// Registers in the prefix cache the full blocks of a request's generated tokens that it
    /// leaves behind (its prompt's are there already): a conversation's next turn, or the
    /// request itself resumed after preemption, then finds its output's KV too. Only for a
    /// request whose steps all succeeded: after a failure the cache content is unknown.
    pub(super) fn cache_output(&mut self, running: &Running) {
        if !self.config.prefix_caching || running.prefilled < running.prompt_len() {
            return;
        }
        // The last sampled token was never fed through the model: its KV is not cached.
        let fed = running.tokens.len().saturating_sub(1);
        let block_size = self.config.block_size.max(1) as usize;
        let known = running.block_hashes.len();
        if (running.request.input_ids.len() + fed) / block_size <= known {
            return;
        }
        let mut sequence = running.request.input_ids.clone();
        sequence.extend_from_slice(&running.tokens[..fed]);
        let hashes = block_hashes(
            &running.request.adapter_id,
            self.adapter_epoch(&running.request.adapter_id),
            &sequence,
            self.config.block_size,
        );
        let allocator = &mut self.resources.allocator;
        for (&block, &hash) in running.blocks.ids().iter().zip(&hashes).skip(known) {
            allocator.register(block, hash);
        }
    }

    /// How many times `adapter_id` was unloaded: part of its blocks' names.
    fn adapter_epoch(&self, adapter_id: &str) -> u64 {
        self.adapter_epochs.get(adapter_id).copied().unwrap_or(0)
    }

    /// The names of `request`'s full prompt blocks for the prefix cache (none when it is off).
    pub(super) fn prefix_hashes(&self, request: &GenerationRequest) -> Vec<BlockHash> {
        if !self.config.prefix_caching {
            return Vec::new();
        }
        block_hashes(
            &request.adapter_id,
            self.adapter_epoch(&request.adapter_id),
            &request.input_ids,
            self.config.block_size,
        )
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
            let first = running.tokens.len() == 1 && running.resumed_after == 0;
            let event = TokenEvent {
                cached_tokens: if first { running.cached_tokens } else { 0 },
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
        self.prefilling.clear();
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

impl Running {
    /// The shard's view of this request for a Prefill computing prompt tokens `from..until`.
    fn to_pb(&self, id: u64, from: u32, until: u32) -> pb::Request {
        let request = &self.request;
        pb::Request {
            id,
            input_ids: request.input_ids.clone(),
            blocks: self.blocks.ids().to_vec(),
            sampling: Some(sampling_to_pb(request, self.resumed_after)),
            max_new_tokens: request.max_new_tokens,
            adapter_id: request.adapter_id.clone(),
            // A resumed request reported its prompt's logprobs before it was preempted.
            prompt_logprobs: request.prompt_logprobs.filter(|_| self.resumed_after == 0),
            grammar: request.grammar.clone(),
            cached_tokens: from,
            prefill_until: if until < self.prompt_len() { until } else { 0 },
        }
    }
}

/// Registers in the prefix cache the full blocks among prompt tokens `from..until` that a
/// Prefill is about to compute, noting them in `registered` so a failed step can take them
/// back. Later requests (in this very Prefill too: the shard writes a layer's KV before any
/// attention of that layer reads it) may then share them.
fn register_computed(
    allocator: &mut BlockAllocator,
    registered: &mut Vec<u32>,
    blocks: &[u32],
    hashes: &[BlockHash],
    from: u32,
    until: u32,
    block_size: u32,
) {
    let first = (from / block_size) as usize;
    let end = ((until / block_size) as usize).min(hashes.len());
    for index in first..end {
        let block = blocks[index];
        if !allocator.is_cached(block) {
            allocator.register(block, hashes[index]);
            if allocator.is_cached(block) {
                registered.push(block);
            }
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
