//! `FakeShard`: an in-memory shard for router tests, deterministic and strict.
//!
//! Tokens: a request's first token is `next(last prompt token)`, every later token is
//! `next(previous token)`, where `next(t) = (t * 31 + 7 + k) % vocab_size` and `k` depends only
//! on the request's adapter: 0 for the base model (`fake_next_token`), and for an adapter id
//! `k = 1 + fnv1a64(id bytes) % (vocab_size - 1)` (`fake_adapter_shift`, `fake_next_token_for`),
//! so every adapter has its own sequence and a request run with the wrong adapter shows.
//! Sampling parameters are ignored; the log-probability of token `t` is `-t / vocab_size`
//! (`fake_logprob`) at every step, so the most likely tokens are `0, 1, 2, ...` and the rank of
//! `t` is `t + 1`: `top_logprobs = k` reports tokens `0..k`, and `prompt_logprobs = k` reports
//! for every prompt token after the first its logprob, its rank and tokens `0..k`.
//! Built `with_seeded_sampling`, a request sampled with `temperature > 0` draws its first token
//! as `(next(last prompt token) + seed) % vocab_size` (`fake_seeded_first_token`), so choices
//! with distinct seeds differ (for `best_of`); a request resumed after preemption does not draw
//! it again.
//! An `embed` request's embedding is `fake_embedding(adapter, prompt)`: its prompt length, last
//! token, adapter shift and token sum modulo the vocabulary, as floats; nothing is kept for it.
//! The fake never decides that a request is finished (the router does, as with the real shard):
//! the EOS id it is built with is only reported by `Info`.
//!
//! It checks what the real shard relies on and answers `InvalidArgument` (never panics) when the
//! router breaks the contract: a batch id that is unknown or already live, a request id already
//! live, an empty prompt, a token id outside the vocabulary, `max_new_tokens == 0`, a block
//! table shorter than `ceil((prompt + max_new_tokens) / block_size)`, a block id outside the
//! cache, a block used twice (by one request, or by two live requests), a Decode whose batch
//! does not list exactly the requests the shard holds, a Decode past a request's
//! `max_new_tokens`, a FilterBatch keeping a request that is not in the batch, a request whose
//! adapter is not active in a slot, a `cached_tokens` whose cache positions do not hold the
//! KV of that adapter and those exact prompt tokens (`fake/kv_content.rs`: every written slot
//! keeps a digest of what its real KV would depend on). Blocks may be shared only within a
//! request's cached prefix. A chunk (`prefill_until` short of the prompt) writes its KV and
//! is not kept. A request's `grammar_id` must name a grammar a `CompileGrammar` pinned and no
//! `ReleaseGrammars` released (`pinned_grammars` counts them). A call that fails changes nothing (except a failed
//! activation, which leaves its slot empty, as a half-written slot would be on a real shard).
//! The adapter RPCs and their own checks are described in `fake/adapters.rs`; Prefill is in
//! `fake/prefill.rs`, Decode, FilterBatch and ClearCache in `fake/decode.rs`, a Decode that
//! carries a Prefill (a mixed step) in `fake/mixed.rs`, the token and embedding rules in
//! `fake/tokens.rs`.
//!
//! Tests can inspect what is still held (`live_requests`, `live_batches`, `stats`,
//! `active_adapters`, `activations`) and make the next call of one RPC fail with `Internal`
//! (`fail_next`; a mixed step fails on a failure injected for Prefill or for Decode).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;

use super::{
    AdapterLoad, CachedBatch, Generation, Grammar, GrammarCompiled, KvLayout, LoadedAdapter,
    MixedStep, PrefillEntry, ShardBackend, ShardError, ShardInfo, ShardResult, Step, WarmupLimits,
};

mod adapters;
mod decode;
mod kv_content;
mod logprobs;
mod mixed;
mod prefill;
mod tokens;

use adapters::AdapterState;
use kv_content::KvContent;
use logprobs::fake_top;
pub use logprobs::{fake_logprob, fake_seeded_first_token};
use prefill::computed_tokens;
use tokens::next_token;
pub use tokens::{
    fake_adapter_shift, fake_embedding, fake_next_token, fake_next_token_for, FAKE_EMBEDDING_DIM,
};

/// One of the shard RPCs, to choose which call `FakeShard::fail_next` breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeRpc {
    Info,
    Health,
    Warmup,
    Prefill,
    Decode,
    FilterBatch,
    ClearCache,
    LoadAdapter,
    ActivateAdapter,
    PrefetchAdapter,
    UnloadAdapter,
}

/// Counters of what the fake was asked to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeShardStats {
    /// Prefills run, on their own or carried by a Decode.
    pub prefill_calls: u64,
    /// Decode calls, those carrying a Prefill included.
    pub decode_calls: u64,
    /// Decode calls that carried a Prefill (mixed steps): the shard calls of the steps are
    /// `prefill_calls + decode_calls - mixed_calls`.
    pub mixed_calls: u64,
    pub filter_calls: u64,
    pub clear_calls: u64,
    /// Most requests seen in one Decode (shows that requests were batched together).
    pub max_decode_batch_size: usize,
    /// Successful ActivateAdapter calls.
    pub activate_calls: u64,
    /// Most distinct adapters (base model not counted) that live requests used at once.
    pub max_live_adapters: usize,
    /// Most distinct adapters (base model not counted) seen in one Decode.
    pub max_decode_adapters: usize,
    /// Prompt tokens each Prefill (on its own or carried) computed (cached ones excluded), in
    /// order.
    pub prefill_tokens: Vec<u32>,
}

#[derive(Debug)]
struct LiveRequest {
    last_token: u32,
    generated: u32,
    max_new_tokens: u32,
    blocks: Vec<u32>,
    /// "" for the base model.
    adapter_id: String,
    /// `k` of the token rule for `adapter_id`.
    shift: u32,
    /// Alternatives reported with each token.
    top_logprobs: u32,
    /// Tokens whose KV is in the cache (where the next fed token is written), and the digest
    /// of the adapter and every token up to the last of them (`fake/kv_content.rs`).
    cached_len: usize,
    digest: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Live batch id → its requests, in batch order.
    batches: HashMap<u64, Vec<u64>>,
    requests: HashMap<u64, LiveRequest>,
    /// Block id → the live requests holding it (more than one only for a shared prefix).
    block_owner: HashMap<u32, HashSet<u64>>,
    /// What every written KV slot holds.
    kv: KvContent,
    fail_next: Option<FakeRpc>,
    /// The message of the `fail_next` failure.
    failure_message: String,
    stats: FakeShardStats,
    adapters: AdapterState,
    grammars: GrammarLog,
}

/// What the fake saw of grammars: it generates no text a grammar could constrain.
#[derive(Debug, Default)]
struct GrammarLog {
    /// `CompileGrammar` answers this error when set.
    refusal: Option<String>,
    compiled: Vec<CompiledGrammar>,
    /// The grammar of every prefilled request, in order (`None`: free).
    prefilled: Vec<Option<Grammar>>,
    /// Pinned grammars by id, from a compile until their release.
    pinned: HashMap<u64, Grammar>,
}

/// One `CompileGrammar` call the fake received.
#[derive(Debug, Clone, PartialEq)]
pub struct CompiledGrammar {
    /// "" is the base model.
    pub adapter_id: String,
    pub grammar: Grammar,
}

/// The in-memory shard; see the module documentation for its rules.
#[derive(Debug)]
pub struct FakeShard {
    vocab_size: u32,
    eos_token_id: Option<u32>,
    block_size: u32,
    num_blocks: u32,
    step_delay: Duration,
    /// Extra Prefill time per computed prompt token.
    prefill_token_delay: Duration,
    /// Extra time of each Decode (a mixed step's too).
    decode_delay: Duration,
    rank: u32,
    world_size: u32,
    model_path: String,
    adapter_load_delay: Duration,
    adapter_activation_delay: Duration,
    seeded_sampling: bool,
    state: Mutex<State>,
}

impl FakeShard {
    /// A shard with `vocab_size` tokens, 1024 blocks of 16 tokens, no EOS and no delay.
    pub fn new(vocab_size: u32) -> Self {
        assert!(vocab_size > 0, "the fake needs a non-empty vocabulary");
        Self {
            vocab_size,
            eos_token_id: None,
            block_size: 16,
            num_blocks: 1024,
            step_delay: Duration::ZERO,
            prefill_token_delay: Duration::ZERO,
            decode_delay: Duration::ZERO,
            rank: 0,
            world_size: 1,
            model_path: String::new(),
            adapter_load_delay: Duration::ZERO,
            adapter_activation_delay: Duration::ZERO,
            seeded_sampling: false,
            state: Mutex::new(State::default()),
        }
    }

    /// EOS id reported by `Info`.
    pub fn with_eos(mut self, eos_token_id: u32) -> Self {
        self.eos_token_id = Some(eos_token_id);
        self
    }

    /// KV cache geometry reported by `Warmup` and enforced on block tables.
    pub fn with_cache(mut self, block_size: u32, num_blocks: u32) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        self.block_size = block_size;
        self.num_blocks = num_blocks;
        self
    }

    /// Time each Prefill and Decode takes (to let requests arrive mid-generation).
    pub fn with_step_delay(mut self, delay: Duration) -> Self {
        self.step_delay = delay;
        self
    }

    /// Time each computed prompt token adds to a Prefill, after the step delay (a shard
    /// whose prefill cost grows with the prompt, for prefill pacing).
    pub fn with_prefill_token_delay(mut self, delay: Duration) -> Self {
        self.prefill_token_delay = delay;
        self
    }

    /// Time each Decode takes, after the step delay.
    pub fn with_decode_delay(mut self, delay: Duration) -> Self {
        self.decode_delay = delay;
        self
    }

    /// Lets the seed of a sampled request choose its first token (see the module docs).
    pub fn with_seeded_sampling(mut self) -> Self {
        self.seeded_sampling = true;
        self
    }

    /// Rank and world size reported by `Info`.
    pub fn with_rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    /// `model_path` reported by `Info` (where the router looks for the tokenizer).
    pub fn with_model_path(mut self, model_path: impl Into<String>) -> Self {
        self.model_path = model_path.into();
        self
    }

    /// Makes the next call of `rpc` fail with `Internal` (and change nothing).
    pub fn fail_next(&self, rpc: FakeRpc) {
        self.fail_next_with(rpc, format!("injected failure of {rpc:?}"));
    }

    /// As `fail_next`, with the status message `message`.
    pub fn fail_next_with(&self, rpc: FakeRpc, message: impl Into<String>) {
        let mut state = self.lock();
        state.fail_next = Some(rpc);
        state.failure_message = message.into();
    }

    /// Requests whose KV the shard still holds.
    pub fn live_requests(&self) -> usize {
        self.lock().requests.len()
    }

    /// Cached batches the shard still holds.
    pub fn live_batches(&self) -> usize {
        self.lock().batches.len()
    }

    pub fn stats(&self) -> FakeShardStats {
        self.lock().stats.clone()
    }

    /// Makes every later `CompileGrammar` answer `error` (the shard's refusal).
    pub fn refuse_grammars(&self, error: impl Into<String>) {
        self.lock().grammars.refusal = Some(error.into());
    }

    /// The `CompileGrammar` calls so far.
    pub fn compiled_grammars(&self) -> Vec<CompiledGrammar> {
        self.lock().grammars.compiled.clone()
    }

    /// Grammars pinned and not released yet.
    pub fn pinned_grammars(&self) -> usize {
        self.lock().grammars.pinned.len()
    }

    /// The grammar of every request prefilled so far (`None` for a free one).
    pub fn prefilled_grammars(&self) -> Vec<Option<Grammar>> {
        self.lock().grammars.prefilled.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the state from the others.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Locks the state, first failing the call if a failure was injected for `rpc`.
    fn begin(&self, rpc: FakeRpc) -> ShardResult<MutexGuard<'_, State>> {
        self.begin_any(&[rpc])
    }

    /// As `begin`, for a call that is any of `rpcs`.
    fn begin_any(&self, rpcs: &[FakeRpc]) -> ShardResult<MutexGuard<'_, State>> {
        let mut state = self.lock();
        if state.fail_next.is_some_and(|rpc| rpcs.contains(&rpc)) {
            state.fail_next = None;
            return Err(ShardError::Status {
                rank: self.rank as usize,
                code: tonic::Code::Internal,
                message: std::mem::take(&mut state.failure_message),
            });
        }
        Ok(state)
    }

    async fn delay(&self) {
        if !self.step_delay.is_zero() {
            tokio::time::sleep(self.step_delay).await;
        }
    }

    fn generation(&self, request_id: u64, previous: u32, shift: u32, top: u32) -> Generation {
        let token_id = next_token(previous, shift, self.vocab_size);
        Generation {
            request_id,
            token_id,
            logprob: fake_logprob(token_id, self.vocab_size),
            top_logprobs: fake_top(top, self.vocab_size),
            prompt_logprobs: Vec::new(),
            embedding: Vec::new(),
        }
    }
}

fn release(state: &mut State, request_id: u64) {
    if let Some(r) = state.requests.remove(&request_id) {
        for block in r.blocks {
            if let Some(owners) = state.block_owner.get_mut(&block) {
                owners.remove(&request_id);
                if owners.is_empty() {
                    state.block_owner.remove(&block);
                }
            }
        }
    }
}

fn invalid(message: String) -> ShardError {
    ShardError::InvalidArgument(message)
}

/// Distinct adapters (not the base model) among `requests`.
fn distinct_adapters<'a>(requests: impl Iterator<Item = &'a LiveRequest>) -> usize {
    requests
        .filter(|r| !r.adapter_id.is_empty())
        .map(|r| r.adapter_id.as_str())
        .collect::<HashSet<_>>()
        .len()
}

impl ShardBackend for FakeShard {
    fn info(&self) -> BoxFuture<'_, ShardResult<ShardInfo>> {
        async move {
            drop(self.begin(FakeRpc::Info)?);
            Ok(ShardInfo {
                model_id: "fake".to_string(),
                model_type: "fake".to_string(),
                dtype: "float32".to_string(),
                device: "cpu".to_string(),
                vocab_size: self.vocab_size,
                max_position_embeddings: 4096,
                rank: self.rank,
                world_size: self.world_size,
                eos_token_ids: self.eos_token_id.into_iter().collect(),
                model_path: self.model_path.clone(),
                weight_bytes: 0, // a fake holds no weights
                embedding_dim: FAKE_EMBEDDING_DIM,
                pooling: "fake".to_string(),
                pooling_refusal: String::new(),
                generation_refusal: String::new(),
            })
        }
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, ShardResult<()>> {
        async move {
            drop(self.begin(FakeRpc::Health)?);
            Ok(())
        }
        .boxed()
    }

    fn warmup(&self, limits: WarmupLimits) -> BoxFuture<'_, ShardResult<KvLayout>> {
        async move {
            self.begin(FakeRpc::Warmup)?
                .adapters
                .set_slots(limits.max_active_adapters, limits.slot_ranks)?;
            let mut num_blocks = self.num_blocks;
            if limits.max_batch_total_tokens > 0 {
                num_blocks = num_blocks.min(limits.max_batch_total_tokens / self.block_size);
            }
            Ok(KvLayout {
                block_size: self.block_size,
                num_blocks,
            })
        }
        .boxed()
    }

    fn prefill(
        &self,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<Step>> {
        async move {
            self.delay().await;
            let computed = computed_tokens(&requests);
            if !self.prefill_token_delay.is_zero() {
                tokio::time::sleep(self.prefill_token_delay * computed).await;
            }
            self.prefill_now(batch_id, requests)
        }
        .boxed()
    }

    fn decode(&self, batches: Vec<CachedBatch>) -> BoxFuture<'_, ShardResult<Step>> {
        async move {
            self.delay().await;
            if !self.decode_delay.is_zero() {
                tokio::time::sleep(self.decode_delay).await;
            }
            self.decode_now(batches)
        }
        .boxed()
    }

    fn decode_with_prefill(
        &self,
        batches: Vec<CachedBatch>,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<MixedStep>> {
        async move {
            self.delay().await;
            // One forward pass: the decode's time plus the prompt tokens'.
            let prefill = self.prefill_token_delay * computed_tokens(&requests);
            let extra = self.decode_delay + prefill;
            if !extra.is_zero() {
                tokio::time::sleep(extra).await;
            }
            self.decode_with_prefill_now(batches, batch_id, requests)
        }
        .boxed()
    }

    fn filter_batch(
        &self,
        batch_id: u64,
        keep: Vec<u64>,
    ) -> BoxFuture<'_, ShardResult<Option<CachedBatch>>> {
        async move { self.filter_now(batch_id, keep) }.boxed()
    }

    fn clear_cache(&self, batch_id: Option<u64>) -> BoxFuture<'_, ShardResult<()>> {
        async move { self.clear_now(batch_id) }.boxed()
    }

    fn load_adapter(&self, load: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>> {
        async move {
            if !self.adapter_load_delay.is_zero() {
                tokio::time::sleep(self.adapter_load_delay).await;
            }
            self.load_adapter_now(load)
        }
        .boxed()
    }

    fn activate_adapter(&self, adapter_id: String, slot: u32) -> BoxFuture<'_, ShardResult<bool>> {
        async move {
            if !self.adapter_activation_delay.is_zero() {
                tokio::time::sleep(self.adapter_activation_delay).await;
            }
            self.activate_adapter_now(adapter_id, slot)
        }
        .boxed()
    }

    fn prefetch_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<bool>> {
        async move { self.prefetch_adapter_now(adapter_id) }.boxed()
    }

    fn unload_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<()>> {
        async move { self.unload_adapter_now(adapter_id) }.boxed()
    }

    fn compile_grammar(
        &self,
        adapter_id: String,
        grammar: Grammar,
        grammar_id: u64,
    ) -> BoxFuture<'_, ShardResult<GrammarCompiled>> {
        async move {
            let mut state = self.lock();
            if grammar_id == 0 {
                return Err(invalid(
                    "a grammar is pinned under a nonzero id".to_string(),
                ));
            }
            let error = state.grammars.refusal.clone();
            if error.is_none() {
                state.grammars.pinned.insert(grammar_id, grammar.clone());
            }
            state.grammars.compiled.push(CompiledGrammar {
                adapter_id,
                grammar,
            });
            Ok(GrammarCompiled {
                error,
                compile_ns: 0,
            })
        }
        .boxed()
    }

    fn release_grammars(&self, grammar_ids: Vec<u64>) -> BoxFuture<'_, ShardResult<()>> {
        async move {
            let mut state = self.lock();
            for id in grammar_ids {
                state.grammars.pinned.remove(&id);
            }
            Ok(())
        }
        .boxed()
    }
}
