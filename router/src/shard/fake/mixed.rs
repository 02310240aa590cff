//! The fake's mixed step: a Decode that carries a Prefill, run as the real shard runs it. The
//! prefill's effect comes first, then the decode's (the new requests' first tokens come from
//! the prefill, so the decode does not step them); the prefill's finished requests then join
//! the decoded batch after its own requests, and no batch of the prefill's id is kept. Both
//! parts are checked before either changes anything, so a rejected call changes nothing.

use super::decode::check_decode;
use super::{FakeRpc, FakeShard};
use crate::shard::{CachedBatch, MixedStep, PrefillEntry, ShardResult};

impl FakeShard {
    pub(super) fn decode_with_prefill_now(
        &self,
        batches: Vec<CachedBatch>,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> ShardResult<MixedStep> {
        // It is a Prefill and a Decode: a failure injected for either breaks it.
        let mut guard = self.begin_any(&[FakeRpc::Decode, FakeRpc::Prefill])?;
        let state = &mut *guard;
        state.stats.mixed_calls += 1;
        state.stats.decode_calls += 1;
        check_decode(state, &batches)?;
        // Rejects a `batch_id` that is live, so one of `batches` too.
        let prefill = self.prefill_in(state, batch_id, requests)?;
        let mut decode = self.apply_decode(state, batches);
        let joined = state.batches.remove(&batch_id).unwrap_or_default();
        if let Some(batch) = decode.batch.as_mut() {
            batch.request_ids.extend(joined);
            state.batches.insert(batch.id, batch.request_ids.clone());
        }
        Ok(MixedStep { decode, prefill })
    }
}
