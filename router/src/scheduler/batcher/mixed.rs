//! A mixed step: one Decode of the running batch that carries the step's planned prefill, so
//! the shard runs the running requests' next tokens and the prompt chunks in one forward pass
//! and reads its weights once for both (`--mixed-prefill`). The requests whose prompt it
//! completes join the running batch on the shard; the running batch afterwards is the decoded
//! batch it returns. A refusal (InvalidArgument: the shard checks every request and batch
//! before it runs or changes anything) takes the step again as a Prefill and a Decode, so a
//! request the shard will not take fails alone and the running streams go on. Any other failure
//! fails every request the call touched and clears the shard, as a failed Decode does, and
//! takes back what the prefill registered in the prefix cache.

use std::sync::atomic::Ordering;

use tokio::time::Instant;

use super::prefill::PlannedPrefill;
use super::{protocol_error, step_attributes, Batcher};
use crate::shard::{CachedBatch, MixedStep, ShardError};
use crate::telemetry::{within_step, StepSpan};

impl Batcher {
    /// Runs `plan` inside the Decode of the running batch (which must exist).
    pub(super) async fn mixed_step(&mut self, plan: PlannedPrefill) {
        let Some(running) = self.running.take() else {
            debug_assert!(false, "a mixed step needs a running batch");
            return;
        };
        // It is a prefill step (counted when planned) and a decode step.
        self.gauges.decode_steps.fetch_add(1, Ordering::Relaxed);
        self.gauges.observed.decode_batch(running.request_ids.len());
        // A Decode on the wire: its span is "decode", with the prompt tokens it carried.
        let step = StepSpan::start(
            "decode",
            || step_attributes(running.id, self.active.len(), plan.prefill_tokens),
            self.active
                .iter()
                .filter_map(|(id, running)| Some((*id, running.trace.as_ref()?))),
        );
        let started = Instant::now();
        // Kept for a refused call's second try as two calls.
        let requests = plan.requests.clone();
        let sent = running.clone();
        let call = self
            .shard
            .decode_with_prefill(vec![running], plan.batch_id, requests);
        let outcome = within_step(step.as_ref(), call).await;
        if outcome.is_ok() {
            self.pace
                .record_mixed(started.elapsed(), plan.prefill_tokens);
        }
        if let Some(step) = step {
            step.end(outcome.as_ref().err().map(|e| e as _));
        }
        let error = match outcome {
            Err(ShardError::InvalidArgument(message)) => {
                // Nothing ran and nothing changed on the shard: a Prefill alone fails only its
                // own requests if one of them is the reason, and the Decode goes on.
                tracing::warn!(%message, "mixed step refused: taken again as a Prefill and a Decode");
                self.running = Some(sent);
                let new_batch = self.prefill(plan).await;
                self.decode(new_batch).await;
                return;
            }
            Ok(answer) => match self.accept_mixed(&plan, &sent, answer) {
                Ok(batch) => {
                    self.running = self.drop_finished(batch).await;
                    return;
                }
                Err(error) => error,
            },
            Err(error) => error,
        };
        self.forget_step_registered();
        // Every live request was in this call, and the shard's state is unknown now.
        self.fail_all(&error).await;
    }

    /// Sends out the step's tokens (the prompts' first ones, then the running requests' next
    /// ones) and returns the batch the shard now runs, checked to be the running batch with the
    /// finished prompts after it: anything else would strand requests whose blocks are held.
    fn accept_mixed(
        &mut self,
        plan: &PlannedPrefill,
        running: &CachedBatch,
        answer: MixedStep,
    ) -> Result<CachedBatch, ShardError> {
        let MixedStep { decode, prefill } = answer;
        tracing::trace!(
            size = decode.generations.len(),
            prefill_size = prefill.generations.len(),
            forward_us = decode.forward_ns / 1000,
            grammar_us = decode.grammar_ns / 1000,
            "mixed step"
        );
        self.gauges.record_grammar(decode.grammar_ns);
        let accepted = self.accept_prefill(plan, prefill);
        self.on_generations(decode.generations);
        accepted?;
        let Some(batch) = decode.batch else {
            return Err(protocol_error("Decode returned no batch"));
        };
        let (own, joined) = batch
            .request_ids
            .split_at_checked(running.request_ids.len())
            .unwrap_or_default();
        if batch.id != running.id || own != running.request_ids || joined != plan.finals {
            return Err(protocol_error(
                "Decode did not return the running batch with the finished prompts joined after it",
            ));
        }
        Ok(batch)
    }
}
