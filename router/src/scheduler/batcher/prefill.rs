//! One step's prefill: the next chunks of prompts under way, then the queued requests that fit
//! the prefill budget (prefix-cache hits cost nothing of it), the blocks they register in the
//! prefix cache, and what a finished request leaves there. Planned once (`plan_prefill`), then
//! run as a Prefill call of its own (`prefill`) or carried by the step's Decode
//! (`batcher/mixed.rs`); both take the answer with `accept_prefill`.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::adapters::Activation;
use super::preemption::Starved;
use super::prefill_share::{share_prefill_budget, Shares};
use super::{protocol_error, step_attributes, Admission, Batcher, Entry, Resources, Running};
use crate::scheduler::blocks::{BlockAllocator, BlockHash};
use crate::scheduler::prefix_hash::block_hashes;
use crate::scheduler::queue::Admit;
use crate::scheduler::GenerationRequest;
use crate::shard::{CachedBatch, PrefillEntry, ShardError, Step};
use crate::telemetry::{within_step, StepSpan};

/// A step's prefill, planned: its requests are in `active` (and the new chunked ones in
/// `prefilling`), the prefix-cache blocks it computes are registered (`step_registered`).
pub(super) struct PlannedPrefill {
    pub(super) batch_id: u64,
    /// What the shard is sent (taken by the call).
    pub(super) requests: Vec<PrefillEntry>,
    /// Every request it computes a part of, in order.
    pub(super) ids: Vec<u64>,
    /// Those whose prompt it completes and that go on decoding: the batch it must return.
    pub(super) finals: Vec<u64>,
    /// Prompt tokens it computes (prefix-cache hits excluded).
    pub(super) prefill_tokens: u64,
}

impl Batcher {
    /// Plans this step's prefill: the next chunks of prompts whose prefill goes on, then the
    /// waiting requests that fit, within the step's budget of computed prompt tokens
    /// (`step_budget`; prefix-cache hits are not computed). `None` when there is nothing to
    /// prefill.
    pub(super) async fn plan_prefill(&mut self) -> Option<PlannedPrefill> {
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
        let budget = u64::from(self.step_budget());
        let shares = self.prefill_shares(budget);
        let mut chunks = self.next_chunks(&shares.under_way);
        let admitted = self.admit_waiting(shares.queue, !chunks.is_empty());
        let used = chunks
            .iter()
            .map(|&(_, from, until)| u64::from(until - from))
            .chain(
                admitted
                    .iter()
                    .map(|(_, a)| u64::from(a.prefill_until - a.cached_tokens)),
            )
            .sum::<u64>();
        self.extend_chunks(&mut chunks, budget.saturating_sub(used));
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
            requests.push(running.prefill_entry(id, from, until));
            prefill_tokens += u64::from(until - from);
            ids.push(id);
        }
        for (entry, admission) in admitted {
            let id = entry.id;
            let running = self.start_running(entry, admission);
            requests.push(running.prefill_entry(id, running.cached_tokens, running.prefilled));
            prefill_tokens += u64::from(running.prefilled - running.cached_tokens);
            if running.prefilled < running.prompt_len() {
                self.prefilling.push(id);
            }
            self.active.insert(id, running);
            ids.push(id);
        }
        // Embedding requests end with this call: they join no batch.
        let finals: Vec<u64> = requests
            .iter()
            .filter(|r| r.prefill_until == 0 && !r.embed)
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
        self.gauges.prefill_steps.fetch_add(1, Ordering::Relaxed);
        Some(PlannedPrefill {
            batch_id,
            requests,
            ids,
            finals,
            prefill_tokens,
        })
    }

    /// Runs `plan` as a Prefill call of its own. Returns the new cached batch of the requests
    /// whose prompt is done, if any is left after its first token.
    pub(super) async fn prefill(&mut self, mut plan: PlannedPrefill) -> Option<CachedBatch> {
        let step = StepSpan::start(
            "prefill",
            || step_attributes(plan.batch_id, plan.ids.len(), plan.prefill_tokens),
            plan.ids.iter().filter_map(|id| self.traced(*id)),
        );
        let started = Instant::now();
        let requests = std::mem::take(&mut plan.requests);
        let call = self.shard.prefill(plan.batch_id, requests);
        let outcome = within_step(step.as_ref(), call).await;
        if outcome.is_ok() {
            self.pace
                .record_prefill(started.elapsed(), plan.prefill_tokens);
        }
        if let Some(step) = step {
            step.end(outcome.as_ref().err().map(|e| e as _));
        }
        let error = match outcome {
            Ok(response) => {
                self.gauges.record_grammar(response.grammar_ns);
                match self.accept_prefill(&plan, response) {
                    Ok(Some(batch)) => return self.drop_finished(batch).await,
                    Ok(None) => return None,
                    Err(error) => error,
                }
            }
            Err(error) => error,
        };
        self.forget_step_registered();
        self.prefilling.retain(|id| !plan.ids.contains(id));
        self.fail_batch(plan.batch_id, &plan.ids, &error).await;
        None
    }

    /// Takes a prefill's answer (on its own or from a mixed step): the prompts it completed
    /// leave `prefilling`, the first tokens go out. Returns the batch of the finished prompts
    /// (`None` when it completed none), or a protocol error when the shard did not keep
    /// exactly those: a batch that lost requests would leave their blocks held for good.
    pub(super) fn accept_prefill(
        &mut self,
        plan: &PlannedPrefill,
        response: Step,
    ) -> Result<Option<CachedBatch>, ShardError> {
        let finals = &plan.finals;
        self.prefilling.retain(|id| !finals.contains(id));
        self.on_generations(response.generations);
        match response.batch {
            Some(batch) if batch.request_ids == *finals => {
                Ok(Some(batch).filter(|_| !finals.is_empty()))
            }
            None if finals.is_empty() => Ok(None),
            _ => Err(protocol_error(
                "Prefill did not return the batch of finished prompts",
            )),
        }
    }

    /// After a failed step: what it registered in the prefix cache was never computed.
    pub(super) fn forget_step_registered(&mut self) {
        for block in std::mem::take(&mut self.step_registered) {
            self.resources.allocator.unregister(block);
        }
    }

    /// Prompt tokens this step may compute (`batcher/pace.rs`). Waiting embeddings do not
    /// lift the pacing: no stream waits on them, and a steady flow of them would otherwise
    /// hold the full budget in every step and stall the decoding streams.
    fn step_budget(&self) -> u32 {
        let decoding = self.running.as_ref().map_or(0, |b| b.request_ids.len());
        let waiting = self.queue.decoding_len() + self.prefilling.len();
        let cap = self.config.max_batch_prefill_tokens.max(1);
        self.pace
            .budget(cap, self.config.block_size.max(1), decoding, waiting)
    }

    /// This step's budget shared between the prompts under way (in `prefilling` order) and
    /// the waiting requests (`prefill_share.rs`).
    fn prefill_shares(&self, budget: u64) -> Shares {
        let under_way: Vec<(&str, u64)> = self
            .prefilling
            .iter()
            .map(|id| {
                let running = &self.active[id];
                let left = running.prompt_len() - running.prefilled;
                (running.request.scope.tenant.as_str(), u64::from(left))
            })
            .collect();
        share_prefill_budget(budget, &under_way, !self.queue.is_empty())
    }

    /// The next chunk of each prompt whose prefill goes on, within its share: (request id,
    /// from, until). A prompt whose share is 0 this step gets no chunk.
    fn next_chunks(&mut self, shares: &[u64]) -> Vec<(u64, u32, u32)> {
        let mut chunks = Vec::new();
        let prefilling = self.prefilling.clone();
        for (&id, &share) in prefilling.iter().zip(shares) {
            if share == 0 {
                continue;
            }
            let from = self.active[&id].prefilled;
            let until = self.advance_prefill(id, share);
            chunks.push((id, from, until));
        }
        chunks
    }

    /// Gives what the waiting requests left of the budget to the chunks of this step, oldest
    /// prompt first, and to prompts under way that got no chunk yet.
    fn extend_chunks(&mut self, chunks: &mut Vec<(u64, u32, u32)>, mut left: u64) {
        for index in 0..self.prefilling.len() {
            if left == 0 {
                break;
            }
            let id = self.prefilling[index];
            let Some(running) = self.active.get(&id) else {
                continue;
            };
            let before = running.prefilled;
            let until = self.advance_prefill(id, left);
            if until == before {
                continue;
            }
            left -= u64::from(until - before);
            match chunks.iter_mut().find(|(chunk, _, _)| *chunk == id) {
                Some(chunk) => chunk.2 = until,
                None => chunks.push((id, before, until)),
            }
        }
    }

    /// Moves request `id`'s prefill on by up to `tokens` and registers the full blocks it
    /// completes in the prefix cache; returns where its prefill now ends.
    fn advance_prefill(&mut self, id: u64, tokens: u64) -> u32 {
        let running = self
            .active
            .get_mut(&id)
            .expect("prefilling requests are active");
        let from = running.prefilled;
        let take = u64::from(running.prompt_len() - from).min(tokens) as u32;
        running.prefilled = from + take;
        register_computed(
            &mut self.resources.allocator,
            &mut self.step_registered,
            running.blocks.ids(),
            &running.block_hashes,
            from,
            from + take,
            self.config.block_size,
        );
        from + take
    }

    /// Takes the waiting requests that fit into this step (`budget` computed prompt tokens
    /// left; `busy`: chunks of earlier prompts are in it already), and starts filling slots for
    /// the adapters that need one.
    fn admit_waiting(&mut self, budget: u64, busy: bool) -> Vec<(Entry, Admission)> {
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
            // An embedding leaves the shard with this step: it takes no batch slot.
            let embed = entry.request.embed;
            if room == 0 && !embed {
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
            // request that wants the prompt's logprobs, or an embedding, computes every prompt
            // token.
            let reusable: &[BlockHash] = if request.prompt_logprobs.is_some() || embed {
                &[]
            } else {
                let most = ((prompt - 1) / block_size) as usize;
                &entry.block_hashes[..most.min(entry.block_hashes.len())]
            };
            let cached = allocator.cached_prefix_len(reusable) * block_size;
            let needed = u64::from(prompt - cached);
            // Prompt logprobs and embeddings come from one pass over the whole prompt: never
            // chunked.
            let chunkable = chunked && request.prompt_logprobs.is_none() && !embed;
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
            } else if slots.is_activating(adapter) {
                return Admit::Skip;
            } else if let Some(slot) = slots.find(adapter, request.adapter_rank) {
                if !slots.holds(adapter) {
                    // Its requests wait in the queue while the slot is filled beside the steps.
                    let evicted = slots.begin_activation(slot, adapter);
                    activations.push(Activation::new(slot, adapter, evicted));
                    return Admit::Skip;
                }
                Some(slot)
            } else {
                waiting_for_slot.push((adapter.to_owned(), request.adapter_rank));
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
                let filled = slots.claim(slot, adapter);
                debug_assert!(filled.is_none(), "admitted before its slot was filled");
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
            room -= usize::from(!embed);
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
        self.start_activations(activations);
        self.prefetch(&waiting_for_slot);
        self.starved = starved;
        self.gauges
            .prefix_queries
            .fetch_add(queried, Ordering::Relaxed);
        self.gauges.prefix_hits.fetch_add(hit, Ordering::Relaxed);
        admitted
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
    pub(in crate::scheduler) fn cache_output(&mut self, running: &Running) {
        if !self.config.prefix_caching
            || running.request.embed
            || running.prefilled < running.prompt_len()
        {
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
            &running.request.scope.cache_scope,
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
    pub(in crate::scheduler) fn prefix_hashes(
        &self,
        request: &GenerationRequest,
    ) -> Vec<BlockHash> {
        if !self.config.prefix_caching {
            return Vec::new();
        }
        block_hashes(
            &request.scope.cache_scope,
            &request.adapter_id,
            self.adapter_epoch(&request.adapter_id),
            &request.input_ids,
            self.config.block_size,
        )
    }
}

impl Running {
    /// The shard's view of this request for a Prefill computing prompt tokens `from..until`.
    fn prefill_entry(&self, id: u64, from: u32, until: u32) -> PrefillEntry {
        let request = &self.request;
        PrefillEntry {
            id,
            input_ids: request.input_ids.clone(),
            blocks: self.blocks.ids().to_vec(),
            sampling: request.sampling.clone(),
            // The draws its generator made before it was preempted.
            draws_done: self.resumed_after,
            max_new_tokens: request.max_new_tokens,
            adapter_id: request.adapter_id.clone(),
            // A resumed request reported its prompt's logprobs before it was preempted.
            prompt_logprobs: request.prompt_logprobs.filter(|_| self.resumed_after == 0),
            grammar_id: request.grammar.as_ref().map(|pin| pin.id()),
            cached_tokens: from,
            prefill_until: if until < self.prompt_len() { until } else { 0 },
            embed: request.embed,
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
