//! The batcher's adapter work: filling device slots for the adapters queued requests need,
//! warming the host copies of adapters that wait for a slot, and unloading adapters whose
//! requests are all done.
//!
//! A slot is filled beside the steps, not between them: ActivateAdapter runs as its own task
//! (the shard copies on a thread of its own, on CUDA on a stream of its own), and the
//! adapter's requests stay queued until it reports back (`finish_activations`). So a cold
//! adapter's copy, or its read from disk when host memory lost it, stalls no running stream.
//! The slot is one no request uses (`slots.rs`), and it takes none until it is filled.

use std::time::Instant;

use opentelemetry::KeyValue;
use tokio::sync::oneshot;

use super::{Batcher, Command};
use crate::scheduler::UnloadError;
use crate::shard::ShardResult;
use crate::telemetry::{within_step, StepSpan};

/// A slot the batcher began to fill for an adapter it did not hold.
pub(super) struct Activation {
    slot: usize,
    adapter: String,
    /// What the slot held before (`None`: it was empty).
    evicted: Option<String>,
}

impl Activation {
    pub(super) fn new(slot: usize, adapter: &str, evicted: Option<String>) -> Self {
        Self {
            slot,
            adapter: adapter.to_owned(),
            evicted,
        }
    }
}

/// What an ActivateAdapter task reports to the loop.
pub(super) struct Activated {
    activation: Activation,
    started: Instant,
    /// True when the weights were still in the shard's host memory.
    outcome: ShardResult<bool>,
}

/// An unload waiting for the adapter's requests to finish; every caller hears the outcome.
pub(super) struct PendingUnload {
    adapter_id: String,
    done: Vec<oneshot::Sender<Result<(), UnloadError>>>,
}

impl Batcher {
    pub(super) fn accept(&mut self, command: Command) {
        match command {
            Command::Submit(mut entry) => {
                if !entry.request.embed {
                    entry.block_hashes = self.prefix_hashes(&entry.request);
                }
                self.queue.push(*entry);
            }
            Command::Unload { adapter_id, done } => {
                tracing::info!(adapter = ?adapter_id, "adapter unload requested");
                match self.unloads.iter_mut().find(|u| u.adapter_id == adapter_id) {
                    Some(pending) => pending.done.push(done),
                    None => self.unloads.push(PendingUnload {
                        adapter_id,
                        done: vec![done],
                    }),
                }
            }
            Command::ReleaseGrammar(id) => self.grammar_releases.push(id),
        }
    }

    /// Starts an ActivateAdapter task for each slot the batcher began to fill.
    pub(super) fn start_activations(&mut self, activations: Vec<Activation>) {
        for activation in activations {
            self.prefetched.remove(&activation.adapter);
            // Traced under the requests that wait for it (the oldest is the parent).
            let step = StepSpan::start(
                "adapter.activate",
                || vec![KeyValue::new("quiver.adapter_slot", activation.slot as i64)],
                self.queue
                    .waiting(&activation.adapter)
                    .filter_map(|entry| Some((entry.id, entry.trace.as_ref()?))),
            );
            let shard = self.shard.clone();
            let done = self.activated_sender.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let call =
                    shard.activate_adapter(activation.adapter.clone(), activation.slot as u32);
                let outcome = within_step(step.as_ref(), call).await;
                if let Some(step) = step {
                    step.end(outcome.as_ref().err().map(|e| e as _));
                }
                // The loop owns the receiver as long as it runs.
                let _ = done.send(Activated {
                    activation,
                    started,
                    outcome,
                });
            });
        }
    }

    /// Warms the shards' host copies of adapters that wait for a slot (with their ranks), once
    /// per wait, so that filling their slot later is a copy, not a read from disk.
    pub(super) fn prefetch(&mut self, waiting: &[(String, u32)]) {
        // An adapter whose requests all left waits no more: a later wait warms it again.
        let queue = &self.queue;
        self.prefetched.retain(|adapter| queue.has_waiting(adapter));
        for (adapter, _) in waiting {
            if !self.prefetched.insert(adapter.clone()) {
                continue;
            }
            let shard = self.shard.clone();
            let gauges = self.gauges.clone();
            let adapter = adapter.clone();
            tokio::spawn(async move {
                // Best effort: a failure here shows again, and fails the requests, when the
                // slot is filled.
                match shard.prefetch_adapter(adapter.clone()).await {
                    Ok(host_cache_hit) => gauges.observed.prefetched(host_cache_hit),
                    Err(error) => {
                        tracing::warn!(adapter = ?adapter, %error, "PrefetchAdapter failed")
                    }
                }
            });
        }
    }

    /// Takes in what the ActivateAdapter tasks reported: a filled slot takes its adapter's
    /// requests from the next step on; a failed one is emptied, and the adapter's queued
    /// requests fail.
    pub(super) fn finish_activations(&mut self) {
        while let Ok(report) = self.activated.try_recv() {
            self.on_activated(report);
        }
    }

    pub(super) fn on_activated(&mut self, report: Activated) {
        let Activated {
            activation:
                Activation {
                    slot,
                    adapter,
                    evicted,
                },
            started,
            outcome,
        } = report;
        match outcome {
            Ok(host_cache_hit) => {
                self.resources.slots.activation_done(slot);
                self.gauges.observed.activated(
                    &adapter,
                    evicted.as_deref(),
                    started.elapsed(),
                    host_cache_hit,
                );
                tracing::info!(adapter = ?adapter, slot, ?evicted, "adapter activated");
            }
            Err(error) => {
                tracing::error!(adapter = ?adapter, slot, %error, "adapter activation failed; failing its requests");
                self.resources.slots.activation_failed(slot);
                let message = error.to_string();
                for entry in self.queue.take_all(&adapter) {
                    entry.fail(&message);
                }
            }
        }
    }

    /// Unloads the adapters none of whose requests is queued or running any more: frees the
    /// slot, then UnloadAdapter on the shard, then tells the callers.
    pub(super) async fn finish_unloads(&mut self) {
        let mut index = 0;
        while index < self.unloads.len() {
            let adapter = &self.unloads[index].adapter_id;
            if self.queue.has_waiting(adapter) || !self.resources.slots.evict(adapter) {
                index += 1;
                continue;
            }
            let PendingUnload { adapter_id, done } = self.unloads.swap_remove(index);
            // Whatever happens on the shard, KV cached for this id is not reused: an adapter
            // loaded again under it may have other weights.
            *self.adapter_epochs.entry(adapter_id.clone()).or_default() += 1;
            let result = match self.shard.unload_adapter(adapter_id.clone()).await {
                Ok(_) => {
                    tracing::info!(adapter = ?adapter_id, "adapter unloaded");
                    Ok(())
                }
                Err(error) => {
                    tracing::error!(adapter = ?adapter_id, %error, "UnloadAdapter failed");
                    Err(UnloadError::Shard(error))
                }
            };
            for caller in done {
                // The caller may have stopped waiting; the unload happened all the same.
                let _ = caller.send(result.clone());
            }
        }
    }
}
