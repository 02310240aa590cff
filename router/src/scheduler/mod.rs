//! Admission, per-adapter queues, KV-block accounting and the continuous-batching loop.
//!
//! The contract with the HTTP layer: `Scheduler::submit` takes a validated
//! `GenerationRequest` and returns a receiver of `TokenEvent`s. Dropping the receiver (client
//! gone, stop string matched) cancels the request: it leaves the batch and its blocks are freed.

use tokio::sync::mpsc;

/// Sampling settings of one request, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// Always set: the client's seed, or one drawn by the router.
    pub seed: u64,
}

/// A request that passed validation; the only thing the scheduler accepts.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub input_ids: Vec<u32>,
    pub max_new_tokens: u32,
    pub sampling: SamplingParams,
    /// Token ids that end generation with `finish_reason: "stop"` (unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// EOS is not honoured before this many tokens.
    pub min_tokens: u32,
    /// "" is the base model.
    pub adapter_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token was generated (it is the event's token).
    Eos,
    /// `max_new_tokens` reached.
    Length,
}

/// One generated token; `finish` is set on the request's last event.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub token_id: u32,
    pub logprob: f32,
    pub finish: Option<FinishReason>,
}

/// Why a running request failed (shard error, shutdown).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum GenerationError {
    #[error("shard error: {0}")]
    Shard(String),
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum AdmissionError {
    #[error("the server is overloaded: too many concurrent requests")]
    Overloaded,
    #[error("request needs {needed} KV blocks but the cache holds only {total}")]
    TooLarge { needed: u32, total: u32 },
    #[error("the server is shutting down")]
    ShuttingDown,
}

pub type EventReceiver = mpsc::UnboundedReceiver<Result<TokenEvent, GenerationError>>;
