//! The fake's Prefill: the checks a new request must pass, chunks that only write KV, and the
//! cached prefix each request relies on, checked against what the cache holds.

use std::collections::HashSet;

use super::kv_content::prefix_digests;
use super::logprobs::prompt_positions;
use super::{
    distinct_adapters, fake_adapter_shift, fake_embedding, fake_logprob, fake_seeded_first_token,
    invalid, FakeRpc, FakeShard, LiveRequest, State,
};
use crate::shard::{CachedBatch, Generation, PrefillEntry, ShardResult, Step};

impl FakeShard {
    fn check_request(&self, state: &State, request: &PrefillEntry) -> ShardResult<()> {
        let id = request.id;
        if state.requests.contains_key(&id) {
            return Err(invalid(format!("request {id} is already live")));
        }
        if request.input_ids.is_empty() {
            return Err(invalid(format!("request {id} has an empty prompt")));
        }
        if let Some(&token) = request.input_ids.iter().find(|&&t| t >= self.vocab_size) {
            return Err(invalid(format!(
                "request {id}: token id {token} is outside the vocabulary ({})",
                self.vocab_size
            )));
        }
        if request.embed {
            if request.max_new_tokens != 0
                || request.cached_tokens != 0
                || request.prefill_until != 0
                || request.prompt_logprobs.is_some()
                || request.grammar_id.is_some()
            {
                return Err(invalid(format!(
                    "request {id}: an embed request computes its whole prompt and nothing else"
                )));
            }
        } else if request.max_new_tokens == 0 {
            return Err(invalid(format!("request {id} asks for no new tokens")));
        }
        let prompt = request.input_ids.len() as u32;
        if request.cached_tokens >= prompt
            || (request.prefill_until != 0
                && !(request.cached_tokens < request.prefill_until
                    && request.prefill_until <= prompt))
        {
            return Err(invalid(format!(
                "request {id}: cached_tokens {} and prefill_until {} do not fit a prompt of {prompt}",
                request.cached_tokens, request.prefill_until
            )));
        }
        if request.cached_tokens > 0 && request.prompt_logprobs.is_some() {
            return Err(invalid(format!(
                "request {id}: prompt logprobs need the whole prompt computed"
            )));
        }
        let needed = request.input_ids.len() as u64 + u64::from(request.max_new_tokens);
        let capacity = request.blocks.len() as u64 * u64::from(self.block_size);
        if capacity < needed {
            return Err(invalid(format!(
                "request {id}: block table holds {capacity} tokens, needs {needed}"
            )));
        }
        for (i, &block) in request.blocks.iter().enumerate() {
            if block >= self.num_blocks {
                return Err(invalid(format!(
                    "request {id}: block {block} is outside the cache ({} blocks)",
                    self.num_blocks
                )));
            }
            // The leading blocks of a cached prefix are only read: others may hold them.
            let shared = (i as u64) * u64::from(self.block_size) < u64::from(request.cached_tokens);
            if let Some(owner) = state.block_owner.get(&block).and_then(|o| o.iter().next()) {
                if !shared {
                    return Err(invalid(format!(
                        "request {id}: block {block} is in use by request {owner}"
                    )));
                }
            }
            if request.blocks[..i].contains(&block) {
                return Err(invalid(format!("request {id}: block {block} listed twice")));
            }
        }
        state.adapters.check_servable(id, &request.adapter_id)
    }

    pub(super) fn prefill_now(
        &self,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> ShardResult<Step> {
        let mut guard = self.begin(FakeRpc::Prefill)?;
        self.prefill_in(&mut guard, batch_id, requests)
    }

    /// A Prefill's checks and effect on `state` (alone, or in a mixed step): a rejected one
    /// changes nothing but the counters.
    pub(super) fn prefill_in(
        &self,
        state: &mut State,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> ShardResult<Step> {
        state.stats.prefill_calls += 1;
        state.stats.prefill_tokens.push(computed_tokens(&requests));
        let mut grammars = Vec::with_capacity(requests.len());
        for r in &requests {
            grammars.push(match r.grammar_id {
                None => None,
                Some(id) => match state.grammars.pinned.get(&id) {
                    Some(grammar) => Some(grammar.clone()),
                    None => {
                        return Err(invalid(format!(
                            "request {}: grammar {id} is not pinned",
                            r.id
                        )))
                    }
                },
            });
        }
        state.grammars.prefilled.extend(grammars);
        if state.batches.contains_key(&batch_id) {
            return Err(invalid(format!("batch {batch_id} is already live")));
        }
        if requests.is_empty() {
            return Err(invalid("prefill of an empty batch".to_string()));
        }
        // Validate everything first (including clashes between the new requests) so a
        // rejected call changes nothing.
        let mut new_ids = HashSet::new();
        let mut new_blocks = HashSet::new();
        for r in &requests {
            self.check_request(state, r)?;
            if !new_ids.insert(r.id) {
                return Err(invalid(format!("request {} listed twice", r.id)));
            }
            let shared = (r.cached_tokens as usize).div_ceil(self.block_size as usize);
            if let Some(block) = r.blocks[shared.min(r.blocks.len())..]
                .iter()
                .find(|b| !new_blocks.insert(**b))
            {
                return Err(invalid(format!("block {block} given to two new requests")));
            }
        }
        // Every request's own KV is written before any reads the cache, as on the real shard,
        // so one may share a prefix another of this call computes.
        let before = state.kv.clone();
        let mut digests = Vec::with_capacity(requests.len());
        for r in &requests {
            let d = prefix_digests(&r.adapter_id, &r.input_ids);
            let until = until_of(r);
            state.kv.write(
                &r.blocks,
                self.block_size,
                &d,
                r.cached_tokens as usize,
                until,
            );
            digests.push(d);
        }
        for (r, d) in requests.iter().zip(&digests) {
            if let Err(message) =
                state
                    .kv
                    .check(&r.blocks, self.block_size, d, r.cached_tokens as usize)
            {
                state.kv = before;
                return Err(invalid(format!("request {}: {message}", r.id)));
            }
        }
        let mut generations = Vec::with_capacity(requests.len());
        let mut ids = Vec::with_capacity(requests.len());
        for (r, d) in requests.into_iter().zip(digests) {
            if until_of(&r) < r.input_ids.len() {
                // A chunk: its KV is written, nothing else is kept.
                continue;
            }
            if r.embed {
                // Its KV is written too; the router frees its blocks when this call returns.
                generations.push(Generation {
                    request_id: r.id,
                    token_id: 0,
                    logprob: 0.0,
                    top_logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    embedding: fake_embedding(&r.adapter_id, &r.input_ids, self.vocab_size),
                });
                continue;
            }
            let last_prompt_token = *r.input_ids.last().unwrap_or(&0);
            let shift = fake_adapter_shift(&r.adapter_id, self.vocab_size);
            let top = r.sampling.top_logprobs;
            let mut generation = self.generation(r.id, last_prompt_token, shift, top);
            if self.seeded_sampling && r.sampling.temperature > 0.0 && r.draws_done == 0 {
                generation.token_id =
                    fake_seeded_first_token(generation.token_id, r.sampling.seed, self.vocab_size);
                generation.logprob = fake_logprob(generation.token_id, self.vocab_size);
            }
            if let Some(k) = r.prompt_logprobs {
                generation.prompt_logprobs = prompt_positions(&r.input_ids, k, self.vocab_size);
            }
            for &block in &r.blocks {
                state.block_owner.entry(block).or_default().insert(r.id);
            }
            state.requests.insert(
                r.id,
                LiveRequest {
                    last_token: generation.token_id,
                    generated: 1,
                    max_new_tokens: r.max_new_tokens,
                    blocks: r.blocks,
                    adapter_id: r.adapter_id,
                    shift,
                    top_logprobs: top,
                    cached_len: d.len(),
                    digest: d.last().copied().unwrap_or(0),
                },
            );
            ids.push(r.id);
            generations.push(generation);
        }
        if !ids.is_empty() {
            state.batches.insert(batch_id, ids.clone());
        }
        let live_adapters = distinct_adapters(state.requests.values());
        state.stats.max_live_adapters = state.stats.max_live_adapters.max(live_adapters);
        Ok(Step {
            generations,
            batch: Some(CachedBatch {
                id: batch_id,
                request_ids: ids,
            }),
            forward_ns: 0,
            grammar_ns: 0,
        })
    }
}

/// End of the prompt part a Prefill computes for `r`.
fn until_of(r: &PrefillEntry) -> usize {
    match r.prefill_until {
        0 => r.input_ids.len(),
        until => until as usize,
    }
}

/// Prompt tokens a Prefill computes: each request's `cached_tokens..prefill_until` (its whole
/// prompt when `prefill_until` is 0).
pub(super) fn computed_tokens(requests: &[PrefillEntry]) -> u32 {
    requests
        .iter()
        .map(|r| (until_of(r) as u32).saturating_sub(r.cached_tokens))
        .sum()
}
