//! Access to the model shards: the `ShardBackend` trait the scheduler drives, the gRPC
//! `ShardClient` that talks to every tensor-parallel rank, and the in-memory `FakeShard` that
//! router tests run against (only with the `test-support` feature, which the crate's own tests
//! turn on: it is not in the release binary).
//!
//! The trait speaks the router's own types (`messages.rs`); protobuf stays behind the gRPC
//! client (`wire.rs` converts), so the scheduler, the adapter registry and the fake know nothing
//! of it.

use std::path::PathBuf;

use futures::future::BoxFuture;

use crate::bounded_text::bounded;

mod client;
#[cfg(any(test, feature = "test-support"))]
mod fake;
mod messages;
mod wire;

#[cfg(test)]
mod client_tests;
#[cfg(test)]
mod fake_adapter_tests;
#[cfg(test)]
mod fake_mixed_tests;
#[cfg(test)]
mod fake_tests;
#[cfg(test)]
mod served_fake;
#[cfg(test)]
mod wire_tests;

pub use client::ShardClient;
#[cfg(any(test, feature = "test-support"))]
pub use fake::{
    fake_adapter_shift, fake_embedding, fake_logprob, fake_next_token, fake_next_token_for,
    fake_seeded_first_token, CompiledGrammar, FakeRpc, FakeShard, FakeShardStats,
};
pub use messages::{
    AdapterLoad, CachedBatch, Generation, Grammar, GrammarCompiled, GrammarKind, KvLayout,
    LoadedAdapter, MixedStep, PrefillEntry, PromptPosition, SamplingParams, ShardInfo, Step,
    TokenLogprob, WarmupLimits,
};

/// Result of one shard call.
pub type ShardResult<T> = Result<T, ShardError>;

/// A failed shard call.
///
/// `InvalidArgument` is the shard saying the router sent something wrong (unknown batch id, a
/// block table too short, a token id outside the vocabulary): a bug in the router or bad input,
/// not a broken shard. Everything else keeps the gRPC code and the message the shard sent.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShardError {
    #[error("shard rejected the call: {0}")]
    InvalidArgument(String),
    #[error("shard rank {rank} failed ({code:?}): {message}")]
    Status {
        rank: usize,
        code: tonic::Code,
        message: String,
    },
    #[error("cannot connect to shard at {path}: {message}", path = .path.display())]
    Connect { path: PathBuf, message: String },
}

impl ShardError {
    /// Maps a gRPC status from rank `rank`, keeping its code and its message, bounded: a shard
    /// message can quote an adapter's files or a client's grammar.
    pub fn from_status(rank: usize, status: &tonic::Status) -> Self {
        let message = bounded(status.message()).into_owned();
        match status.code() {
            tonic::Code::InvalidArgument => Self::InvalidArgument(message),
            code => Self::Status {
                rank,
                code,
                message,
            },
        }
    }

    /// The gRPC code this error carries (`Unavailable` for a failed connection).
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::InvalidArgument(_) => tonic::Code::InvalidArgument,
            Self::Status { code, .. } => *code,
            Self::Connect { .. } => tonic::Code::Unavailable,
        }
    }

    /// The shard's own message, without our prefix.
    pub fn message(&self) -> &str {
        match self {
            Self::InvalidArgument(message)
            | Self::Status { message, .. }
            | Self::Connect { message, .. } => message,
        }
    }
}

/// The shard service as the router sees it: one logical model, however many ranks serve it.
///
/// Object-safe (methods return boxed futures) so the scheduler holds an
/// `Arc<dyn ShardBackend>` and tests swap in `FakeShard`.
pub trait ShardBackend: Send + Sync {
    /// A rank is unreachable: a call failed at the transport (its process died, its socket
    /// closed, or the connection broke). The client dials again in the background and the shard
    /// is available again once every rank answers `Health`; a process that died does not come
    /// back, and the launcher restarts the whole stack.
    fn is_unavailable(&self) -> bool {
        false
    }
    fn info(&self) -> BoxFuture<'_, ShardResult<ShardInfo>>;
    /// Every rank's `Info`, by rank (rank 0's alone where there is one rank).
    fn rank_infos(&self) -> BoxFuture<'_, ShardResult<Vec<ShardInfo>>> {
        Box::pin(async move { Ok(vec![self.info().await?]) })
    }
    fn health(&self) -> BoxFuture<'_, ShardResult<()>>;
    /// Sizes the KV cache and the adapter slots for what the router will ask.
    fn warmup(&self, limits: WarmupLimits) -> BoxFuture<'_, ShardResult<KvLayout>>;
    /// Runs `requests` (prompts, or chunks of them) and keeps the finished prompts as the
    /// cached batch `batch_id`.
    fn prefill(
        &self,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<Step>>;
    /// One decode step over the union of `batches`, merged into the first one's id.
    fn decode(&self, batches: Vec<CachedBatch>) -> BoxFuture<'_, ShardResult<Step>>;
    /// One decode step over the union of `batches` (merged into the first one's id) that also
    /// runs the Prefill `batch_id`/`requests` in the same forward pass: the prompts' finished
    /// requests join the decoded batch after its own, and no batch `batch_id` is kept.
    fn decode_with_prefill(
        &self,
        batches: Vec<CachedBatch>,
        batch_id: u64,
        requests: Vec<PrefillEntry>,
    ) -> BoxFuture<'_, ShardResult<MixedStep>>;
    /// Keeps only `keep` of batch `batch_id`; `None` when nothing is left of it.
    fn filter_batch(
        &self,
        batch_id: u64,
        keep: Vec<u64>,
    ) -> BoxFuture<'_, ShardResult<Option<CachedBatch>>>;
    /// Drops one cached batch, or all of them.
    fn clear_cache(&self, batch_id: Option<u64>) -> BoxFuture<'_, ShardResult<()>>;
    /// Loads an adapter into every rank's host memory. A hub adapter with no `path` is
    /// downloaded by rank 0 only; the other ranks then load rank 0's returned path.
    fn load_adapter(&self, load: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>>;
    /// Copies a loaded adapter into a device slot; the scheduler calls it beside the steps,
    /// never for a slot that running requests use, and admits the adapter's requests once it
    /// returns. True when its weights were still in host memory.
    fn activate_adapter(&self, adapter_id: String, slot: u32) -> BoxFuture<'_, ShardResult<bool>>;
    /// Brings a loaded adapter's weights back into host memory on every rank if they were
    /// evicted; true when they were there already.
    fn prefetch_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<bool>>;
    /// Forgets an adapter (slot and host copy); called once no request uses it.
    fn unload_adapter(&self, adapter_id: String) -> BoxFuture<'_, ShardResult<()>>;
    /// Compiles a request's grammar on every rank before the request is admitted, and pins it
    /// under `grammar_id` until `release_grammars`; a grammar that does not compile comes back
    /// in `error` (rank 0's) and is not pinned.
    fn compile_grammar(
        &self,
        adapter_id: String,
        grammar: Grammar,
        grammar_id: u64,
    ) -> BoxFuture<'_, ShardResult<GrammarCompiled>>;
    /// Unpins grammars no request uses any more (ids not pinned are ignored).
    fn release_grammars(&self, grammar_ids: Vec<u64>) -> BoxFuture<'_, ShardResult<()>>;
}
