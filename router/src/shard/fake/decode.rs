//! The fake's Decode, FilterBatch and ClearCache: the batch checks of the module doc of
//! `fake.rs`, and what each call keeps or frees.

use std::collections::HashSet;

use super::kv_content::next_digest;
use super::{distinct_adapters, invalid, release, FakeRpc, FakeShard, State};
use crate::shard::{CachedBatch, ShardResult, Step};

impl FakeShard {
    pub(super) fn decode_now(&self, batches: Vec<CachedBatch>) -> ShardResult<Step> {
        let mut guard = self.begin(FakeRpc::Decode)?;
        let state = &mut *guard;
        state.stats.decode_calls += 1;
        check_decode(state, &batches)?;
        Ok(self.apply_decode(state, batches))
    }

    /// A Decode's effect on `state`, once `check_decode` passed: the batches merged into the
    /// first one's id, each request's next token.
    pub(super) fn apply_decode(&self, state: &mut State, batches: Vec<CachedBatch>) -> Step {
        let merged_id = batches.first().map_or(0, |first| first.id);
        let mut merged = Vec::new();
        for batch in &batches {
            if let Some(ids) = state.batches.remove(&batch.id) {
                merged.extend(ids);
            }
        }
        let mut generations = Vec::with_capacity(merged.len());
        for id in &merged {
            if let Some(r) = state.requests.get_mut(id) {
                r.digest = next_digest(r.digest, r.last_token);
                let position = r.cached_len;
                r.cached_len += 1;
                state
                    .kv
                    .write_one(&r.blocks, self.block_size, position, r.digest);
                let generation = self.generation(*id, r.last_token, r.shift, r.top_logprobs);
                r.last_token = generation.token_id;
                r.generated += 1;
                generations.push(generation);
            }
        }
        state.stats.max_decode_batch_size = state.stats.max_decode_batch_size.max(merged.len());
        let decode_adapters =
            distinct_adapters(merged.iter().filter_map(|id| state.requests.get(id)));
        state.stats.max_decode_adapters = state.stats.max_decode_adapters.max(decode_adapters);
        state.batches.insert(merged_id, merged.clone());
        Step {
            generations,
            batch: Some(CachedBatch {
                id: merged_id,
                request_ids: merged,
            }),
            forward_ns: 0,
            grammar_ns: 0,
        }
    }

    pub(super) fn filter_now(
        &self,
        batch_id: u64,
        keep_ids: Vec<u64>,
    ) -> ShardResult<Option<CachedBatch>> {
        let mut guard = self.begin(FakeRpc::FilterBatch)?;
        let state = &mut *guard;
        state.stats.filter_calls += 1;
        let Some(held) = state.batches.get(&batch_id) else {
            return Err(invalid(format!("unknown batch {batch_id}")));
        };
        let mut keep = HashSet::new();
        for id in &keep_ids {
            if !held.contains(id) {
                return Err(invalid(format!("request {id} is not in batch {batch_id}")));
            }
            if !keep.insert(*id) {
                return Err(invalid(format!("request {id} listed twice")));
            }
        }
        let held = state.batches.remove(&batch_id).unwrap_or_default();
        let (kept, dropped): (Vec<u64>, Vec<u64>) =
            held.into_iter().partition(|id| keep.contains(id));
        for id in dropped {
            release(state, id);
        }
        if kept.is_empty() {
            // Keeping nothing drops the batch.
            return Ok(None);
        }
        state.batches.insert(batch_id, kept.clone());
        Ok(Some(CachedBatch {
            id: batch_id,
            request_ids: kept,
        }))
    }

    pub(super) fn clear_now(&self, batch_id: Option<u64>) -> ShardResult<()> {
        let mut guard = self.begin(FakeRpc::ClearCache)?;
        let state = &mut *guard;
        state.stats.clear_calls += 1;
        let ids: Vec<u64> = match batch_id {
            Some(batch_id) => match state.batches.remove(&batch_id) {
                Some(ids) => ids,
                None => return Err(invalid(format!("unknown batch {batch_id}"))),
            },
            None => {
                state.batches.clear();
                state.requests.keys().copied().collect()
            }
        };
        for id in ids {
            release(state, id);
        }
        Ok(())
    }
}

/// A Decode's checks, which change nothing: every batch live, listed once and holding exactly
/// the requests the router sent, none of them past its `max_new_tokens`.
pub(super) fn check_decode(state: &State, batches: &[CachedBatch]) -> ShardResult<()> {
    if batches.is_empty() {
        return Err(invalid("decode of no batches".to_string()));
    }
    let mut seen = HashSet::new();
    for batch in batches {
        if !seen.insert(batch.id) {
            return Err(invalid(format!("batch {} listed twice", batch.id)));
        }
        let Some(held) = state.batches.get(&batch.id) else {
            return Err(invalid(format!("unknown batch {}", batch.id)));
        };
        if *held != batch.request_ids {
            return Err(invalid(format!(
                "batch {} holds requests {held:?}, the router sent {:?}",
                batch.id, batch.request_ids
            )));
        }
        for id in held {
            let Some(r) = state.requests.get(id) else {
                continue;
            };
            if r.generated >= r.max_new_tokens {
                return Err(invalid(format!(
                    "request {id} already has its {} new tokens",
                    r.max_new_tokens
                )));
            }
        }
    }
    Ok(())
}
