//! Access to the model shards: the `ShardBackend` trait the scheduler drives, the gRPC
//! `ShardClient` that talks to every tensor-parallel rank, and the in-memory `FakeShard` that
//! router tests run against (only with the `test-support` feature, which the crate's own tests
//! turn on: it is not in the release binary).
//!
//! The trait speaks the `crate::pb` messages of `proto/quiver/v1/shard.proto` directly, so the
//! real client adds no conversion layer and the fake implements exactly the contract the Python
//! shard does.

use std::path::PathBuf;

use futures::future::BoxFuture;

use crate::pb;

mod client;
#[cfg(any(test, feature = "test-support"))]
mod fake;

#[cfg(test)]
mod client_tests;
#[cfg(test)]
mod fake_adapter_tests;
#[cfg(test)]
mod fake_tests;

pub use client::ShardClient;
#[cfg(any(test, feature = "test-support"))]
pub use fake::{
    fake_adapter_shift, fake_embedding, fake_logprob, fake_next_token, fake_next_token_for,
    fake_seeded_first_token, FakeRpc, FakeShard, FakeShardStats,
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
    /// Maps a gRPC status from rank `rank`, keeping its code and message.
    pub fn from_status(rank: usize, status: &tonic::Status) -> Self {
        match status.code() {
            tonic::Code::InvalidArgument => Self::InvalidArgument(status.message().to_string()),
            code => Self::Status {
                rank,
                code,
                message: status.message().to_string(),
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
    /// The shard is known to be gone (a call failed at the transport: its process died or its
    /// socket closed). It does not come back: the launcher restarts the whole stack.
    fn is_unavailable(&self) -> bool {
        false
    }
    fn info(&self) -> BoxFuture<'_, ShardResult<pb::InfoResponse>>;
    /// Every rank's `Info`, by rank (rank 0's alone where there is one rank).
    fn rank_infos(&self) -> BoxFuture<'_, ShardResult<Vec<pb::InfoResponse>>> {
        Box::pin(async move { Ok(vec![self.info().await?]) })
    }
    fn health(&self) -> BoxFuture<'_, ShardResult<pb::HealthResponse>>;
    fn warmup(&self, request: pb::WarmupRequest) -> BoxFuture<'_, ShardResult<pb::WarmupResponse>>;
    fn prefill(
        &self,
        request: pb::PrefillRequest,
    ) -> BoxFuture<'_, ShardResult<pb::PrefillResponse>>;
    fn decode(&self, request: pb::DecodeRequest) -> BoxFuture<'_, ShardResult<pb::DecodeResponse>>;
    fn filter_batch(
        &self,
        request: pb::FilterBatchRequest,
    ) -> BoxFuture<'_, ShardResult<pb::FilterBatchResponse>>;
    fn clear_cache(
        &self,
        request: pb::ClearCacheRequest,
    ) -> BoxFuture<'_, ShardResult<pb::ClearCacheResponse>>;
    /// Loads an adapter into every rank's host memory. A hub adapter with no `path` is
    /// downloaded by rank 0 only; the other ranks then load rank 0's returned path.
    fn load_adapter(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, ShardResult<pb::LoadAdapterResponse>>;
    /// Copies a loaded adapter into a device slot; the scheduler calls it between steps, never
    /// for a slot that running requests use.
    fn activate_adapter(
        &self,
        request: pb::ActivateAdapterRequest,
    ) -> BoxFuture<'_, ShardResult<pb::ActivateAdapterResponse>>;
    /// Forgets an adapter (slot and host copy); called once no request uses it.
    fn unload_adapter(
        &self,
        request: pb::UnloadAdapterRequest,
    ) -> BoxFuture<'_, ShardResult<pb::UnloadAdapterResponse>>;
    /// Compiles (and caches) a request's grammar on every rank before the request is admitted;
    /// a grammar that does not compile comes back in the response's `error` (rank 0's).
    fn compile_grammar(
        &self,
        request: pb::CompileGrammarRequest,
    ) -> BoxFuture<'_, ShardResult<pb::CompileGrammarResponse>>;
}
