//! Bounded waits: preempting running requests for a queue head that waited too long, and the
//! optional queue deadline.
//!
//! Blocks are reserved in full at admission (`batcher.rs`), so without this the request at the
//! head of a queue would wait for as long as the running requests take to finish. Once it has
//! waited `preemption_wait` and still cannot get its blocks or a batch slot, running requests
//! are preempted before the next step: taken out of the shard's batch (FilterBatch), their
//! blocks and adapter slots freed, and queued again at the back of their adapter's queue. They
//! resume by recomputation: the prompt becomes the prompt plus the tokens generated so far, and
//! what is left of `max_tokens` and `min_tokens` carries over. The event channel stays the
//! same, so a client's stream just goes on.
//!
//! Victims: only requests that ran for at least `preemption_wait` since their last prefill (so
//! a resumed request is not thrown out again at once, and every run makes progress), most
//! blocks first (the fewest victims for the room needed), newest first among equals. Nothing is
//! preempted when all eligible victims together would not make room; the head then waits until
//! more become eligible, at most another `preemption_wait`.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::{Batcher, Entry, Running};
use crate::scheduler::GenerationError;

/// What the starved queue head needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Starved {
    blocks: u32,
    /// It was stopped by a full batch (`max_batch_size`), not only by blocks.
    needs_room: bool,
}

impl Starved {
    pub(super) fn new(blocks: u32, needs_room: bool) -> Self {
        Self { blocks, needs_room }
    }
}

impl Batcher {
    /// Fails queued requests that waited longer than `max_queue_wait`. A preempted request is
    /// exempt: it has streamed tokens already and resumes within the preemption bound.
    pub(super) fn expire_queued(&mut self) {
        let Some(limit) = self.config.max_queue_wait else {
            return;
        };
        let now = Instant::now();
        self.queue.retain(|entry| {
            let waited = now.duration_since(entry.queued_at);
            if entry.resumed_after > 0 || waited < limit {
                return true;
            }
            tracing::info!(
                request_id = entry.id,
                waited_ms = waited.as_millis() as u64,
                "queue wait limit reached; request refused"
            );
            let _ = entry.events.send(Err(GenerationError::QueueTimeout {
                waited_secs: waited.as_secs(),
                limit_secs: limit.as_secs(),
            }));
            false
        });
    }

    /// Preempts running requests until `starved` fits, if the eligible ones can make room.
    pub(super) async fn preempt_for(&mut self, starved: Starved) {
        let free = self.resources.allocator.free_count();
        let max_batch_size = self.config.max_batch_size.max(1) as usize;
        let blocks_short = starved.blocks.saturating_sub(free);
        let room_short = usize::from(starved.needs_room && self.active.len() >= max_batch_size);
        if blocks_short == 0 && room_short == 0 {
            return;
        }
        let now = Instant::now();
        let patience = self.config.preemption_wait;
        let mut candidates: Vec<(usize, u64)> = self
            .active
            .iter()
            .filter(|(_, running)| now.duration_since(running.admitted_at) >= patience)
            // A prompt still being prefilled is in no shard batch to take it out of.
            .filter(|(_, running)| running.prefilled == running.request.input_ids.len() as u32)
            .map(|(&id, running)| (running.blocks.len(), id))
            .collect();
        // Most blocks first; among equals the newest (highest id), which has done least work.
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        let mut victims = Vec::new();
        let mut freed = 0u32;
        for (blocks, id) in candidates {
            if freed >= blocks_short && victims.len() >= room_short {
                break;
            }
            freed += blocks as u32;
            victims.push(id);
        }
        if freed < blocks_short || victims.len() < room_short {
            return;
        }
        self.preempt(&victims).await;
    }

    /// Takes `victims` out of the running batch on the shard and queues them again.
    async fn preempt(&mut self, victims: &[u64]) {
        // Victims are in the running batch (none is mid-prefill).
        let Some(mut batch) = self.running.take() else {
            return;
        };
        batch.request_ids.retain(|id| !victims.contains(id));
        if batch.request_ids.is_empty() {
            self.clear_cache(Some(batch.id)).await;
        } else {
            let filter = self.shard.filter_batch(batch.id, batch.request_ids.clone());
            match filter.await {
                Ok(kept) => self.running = Some(kept.unwrap_or(batch)),
                Err(error) => {
                    // The batch's state on the shard is unknown now: fail all of it.
                    let mut ids = batch.request_ids.clone();
                    ids.extend_from_slice(victims);
                    self.fail_batch(batch.id, &ids, &error).await;
                    return;
                }
            }
        }
        for id in victims {
            if let Some(running) = self.active.remove(id) {
                // Its resumed prompt (prompt + output) then starts with cached blocks.
                self.cache_output(&running);
                self.requeue(*id, running);
            }
        }
        self.gauges
            .preemptions
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
    }

    /// Frees a preempted request's blocks and slot and queues it to resume where it stopped.
    fn requeue(&mut self, id: u64, running: Running) {
        let Running {
            events,
            blocks,
            slot,
            permit,
            mut request,
            tokens,
            resumed_after,
            trace,
            ..
        } = running;
        let blocks_needed = blocks.len() as u32;
        self.resources.allocator.free(blocks);
        if let Some(slot) = slot {
            self.resources.slots.release(slot);
        }
        if events.is_closed() {
            return;
        }
        let generated = tokens.len() as u32;
        tracing::info!(
            request_id = id,
            generated = resumed_after + generated,
            blocks = blocks_needed,
            "request preempted; it resumes by recomputation"
        );
        // Prompt + max_new_tokens is unchanged, so the same number of blocks covers it.
        request.input_ids.extend_from_slice(&tokens);
        request.max_new_tokens = request.max_new_tokens.saturating_sub(generated);
        request.min_tokens = request.min_tokens.saturating_sub(generated);
        let mut entry = Entry::new(id, request, blocks_needed, events, permit);
        entry.block_hashes = self.prefix_hashes(&entry.request);
        entry.resumed_after = resumed_after + generated;
        entry.trace = trace.map(|mut trace| {
            trace.requeued();
            trace
        });
        self.queue.push(entry);
    }
}
