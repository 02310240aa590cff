//! The batcher's adapter work between steps: activating the slots a new batch claimed, and
//! unloading adapters whose requests are all done.
//!
//! Both run only between shard steps (before a Prefill), so no running request ever sees its
//! slot change: a slot is claimed for a new adapter only when no request uses it (`slots.rs`).

use opentelemetry::KeyValue;
use tokio::sync::oneshot;

use super::{Admission, Batcher, Command, Entry};
use crate::scheduler::UnloadError;
use crate::telemetry::{within_step, StepSpan};

/// A slot the batch being built claimed for an adapter the slot does not hold yet.
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

    /// Activates the claimed slots. An adapter whose activation fails loses its slot, and its
    /// requests (in this batch and still queued) fail; the rest of the batch goes on.
    pub(super) async fn activate(
        &mut self,
        activations: Vec<Activation>,
        mut admitted: Vec<(Entry, Admission)>,
    ) -> Vec<(Entry, Admission)> {
        for Activation {
            slot,
            adapter,
            evicted,
        } in activations
        {
            let started = std::time::Instant::now();
            // Traced under the requests that wait for it (the oldest is the parent).
            let step = StepSpan::start(
                "adapter.activate",
                || vec![KeyValue::new("quiver.adapter_slot", slot as i64)],
                admitted
                    .iter()
                    .filter(|(entry, _)| entry.request.adapter_id == adapter)
                    .filter_map(|(entry, _)| Some((entry.id, entry.trace.as_ref()?))),
            );
            let outcome = within_step(
                step.as_ref(),
                self.shard.activate_adapter(adapter.clone(), slot as u32),
            )
            .await;
            if let Some(step) = step {
                step.end(outcome.as_ref().err().map(|e| e as _));
            }
            let error = match outcome {
                Ok(host_cache_hit) => {
                    self.gauges.observed.activated(
                        &adapter,
                        evicted.as_deref(),
                        started.elapsed(),
                        host_cache_hit,
                    );
                    tracing::info!(adapter = ?adapter, slot, ?evicted, "adapter activated");
                    continue;
                }
                Err(error) => error,
            };
            tracing::error!(adapter = ?adapter, slot, %error, "adapter activation failed; failing its requests");
            self.resources.slots.activation_failed(slot);
            let message = error.to_string();
            let (failed, kept): (Vec<_>, Vec<_>) = admitted
                .into_iter()
                .partition(|(entry, _)| entry.request.adapter_id == adapter);
            admitted = kept;
            for (entry, admission) in failed {
                // Blocks it registered for the prefix cache this step will never be computed.
                for block in admission.blocks.ids() {
                    if self.step_registered.contains(block) {
                        self.resources.allocator.unregister(*block);
                    }
                }
                self.resources.allocator.free(admission.blocks);
                entry.fail(&message);
            }
            for entry in self.queue.take_all(&adapter) {
                entry.fail(&message);
            }
        }
        admitted
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
